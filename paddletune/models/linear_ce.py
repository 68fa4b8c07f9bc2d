"""Chunked LM head + cross-entropy for training: sum_i CE(h_i W, t_i) without the [n, V] logits.

h [n, H], W [H, V] (or [V, H] with transposed=True, a tied embedding), t [n] -> scalar.
Rows are cut into blocks; each block computes logits_b = h_b W and (loss_b, p_b) = softmax CE, and
since the loss is a sum its gradients are already known up to the upstream scalar g:
    dL/dlogits_b = p_b - onehot(t_b),  dh_b = (p_b - onehot) W^T,  dW += h_b^T (p_b - onehot)
so backward only multiplies the stored dh (and dW when W trains) by g. Same FLOPs as autograd (dW
is skipped for a frozen head, as under LoRA), but memory holds one [rows, V] block
instead of logits + softmax + their gradients ([n, V] each: 131 MB at n=1024, V=32000).
"""
import paddle
from paddle import _C_ops

from .. import kernels
from .layers import wide


def _blocks(h, w, t, transposed, want_dh, want_dw, spans):
    """(loss sum, [dh per span], dW or None) for the row spans [(lo, hi)], in order."""
    loss, dh, dw = None, [], None
    for lo, hi in spans:
        hc, tc = h[lo:hi], t[lo:hi]
        logits = paddle.matmul(hc, w, transpose_y=transposed)
        logits = logits.astype(wide(logits.dtype))   # float32 for 16-bit models, else as is
        lc = kernels.softmax_xent_(logits, tc)   # loss rows, logits -> p - onehot in place; or None
        if lc is not None:
            p = logits
        else:
            p, lc = _C_ops.cross_entropy_with_softmax(logits, tc.unsqueeze(-1), False, True, True, -100, -1)
            # p - onehot(t) in place: both gradients below are then plain products
            p.put_along_axis_(tc.unsqueeze(-1), paddle.full([hi - lo, 1], -1.0, p.dtype), 1, "add")
        del logits
        loss = lc.sum() if loss is None else loss + lc.sum()
        if want_dh:
            dh.append(paddle.matmul(p.astype(w.dtype), w, transpose_y=not transposed))
        if want_dw:
            h32 = hc.astype(p.dtype)
            part = paddle.matmul(p, h32, transpose_x=True) if transposed else paddle.matmul(h32, p, transpose_x=True)
            dw = part if dw is None else dw.add_(part)
    return loss, dh, dw


class LinearCrossEntropy(paddle.autograd.PyLayer):
    """LinearCrossEntropy.apply(h, w, t, transposed) -> summed CE (see the module docstring)."""

    # elements of one [rows, V] logits block: 1000 rows at V=32000 (128 MB of float32, which the
    # CPU kernel turns into the gradient in place). Smaller blocks save memory but cost speed:
    # paddle's CPU matmul runs [128, 256] x [256, 32000] 1.7x slower than 256+ rows, and the
    # docs/design.md section 5 LoRA step is ~10 ms faster with one 1020-row block than with 250-row ones
    BLOCK_ELEMENTS = 32_000_000

    @staticmethod
    def forward(ctx, h, w, t, transposed):
        V = w.shape[0] if transposed else w.shape[1]
        n = h.shape[0]
        want_dh, want_dw = not h.stop_gradient, not w.stop_gradient
        rows = max(1, LinearCrossEntropy.BLOCK_ELEMENTS // V)
        if not (h.place.is_cpu_place() and kernels.cpu_ops() is not None):
            rows = max(1, rows // 4)   # paddle's loss keeps logits and p: two blocks alive
        spans = [(i, min(i + rows, n)) for i in range(0, n, rows)]
        with paddle.no_grad():
            loss, dh, dw = _blocks(h.detach(), w.detach(), t, transposed, want_dh, want_dw, spans)
            ctx.dh = (paddle.concat(dh) if len(dh) > 1 else dh[0]) if want_dh else None
        ctx.dw = dw
        ctx.dtypes = (h.dtype, w.dtype)
        return loss

    @staticmethod
    def backward(ctx, g):
        dh = (ctx.dh * g).astype(ctx.dtypes[0]) if ctx.dh is not None else None
        dw = (ctx.dw * g).astype(ctx.dtypes[1]) if ctx.dw is not None else None
        return dh, dw
