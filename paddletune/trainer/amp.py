"""Mixed precision for the Trainer: paddle.amp.decorate once, auto_cast per forward, fp16 loss
scaling with paddle.amp.GradScaler (issue 32).

Keys (PaddleNLP's names where PaddleNLP has them):
  bf16 / fp16            compute dtype bfloat16 / float16 (CPU: float32, warned once; paddle's CPU
                         build has float32 matmuls only, and decorate / auto_cast / GradScaler switch
                         themselves off on a CPU place: amp/auto_cast.py, amp/grad_scaler.py)
  fp16_opt_level         O1: float32 weights, white-listed ops (matmul, ...) run in the compute dtype;
                         O2: weights cast to the compute dtype by paddle.amp.decorate, float32 master
                         weights in paddle's AdamW (multi_precision), the float32 islands below kept
  amp_master_grad        O2: float32 gradients (decorate's master_grad)
  amp_custom_white_list / amp_custom_black_list   ops forced to / kept out of the compute dtype
  scale_loss             fp16: the GradScaler's initial scale (bf16 has float32's range: no scaling)
  amp_incr_ratio, amp_decr_ratio, amp_incr_every_n_steps, amp_decr_every_n_nan_or_inf
                         the GradScaler's dynamic-scale rule (paddle's argument names and defaults;
                         PaddleNLP exposes scale_loss only)
  amp_skip_limit         K: the run stops after K consecutive skipped (overflowed) steps, or when
                         the scale falls below 1 (default 20; see Precision.after_step)

Float32 islands under O2 (decorate's excluded_layers): RMSNorm / LayerNorm weights (their
statistics run in float32 anyway; a bf16 weight would round every normalised activation), MoE
routers (the top-k choice flips on bf16 rounding of near-equal logits), LoRA A / B (the adapter is
what trains: its updates are ~1e-4 of the weights, below bf16's 2^-8 step), quantized base layers
(their float scales / absmax tables must stay as quantized; PaddleNLP excludes QuantizationLinear).

Order (why decorate comes before the optimizer): paddle's AdamW creates a float32 master copy of
a 16-bit parameter when its accumulators are created; decorate(models=...) casts first, then the
Trainer builds AdamW with multi_precision=True, so every 16-bit parameter gets its master.
"""
import logging

import paddle

from ..args import ArgumentError
from ..runtime import amp_settings, amp_unsupported

logger = logging.getLogger("paddletune")


def float32_layers(model):
    """The layers paddle.amp.decorate(level="O2") leaves in float32: layer types and instances
    (decorate's excluded_layers argument). See the module docstring for why each."""
    from ..models.layers import RMSNorm
    from ..models.moe import SparseMoeBlock
    from ..peft.lora import LoRALinear
    from ..quant.weight_only import QuantizedLinear

    keep = [RMSNorm, paddle.nn.LayerNorm, QuantizedLinear]
    for layer in model.sublayers(include_self=True):
        if isinstance(layer, SparseMoeBlock):
            keep.append(layer.gate)
            if hasattr(layer, "shared_expert_gate"):
                keep.append(layer.shared_expert_gate)
        elif isinstance(layer, LoRALinear):
            keep += [layer.lora_A, layer.lora_B]
    return keep


def _op_list(value):
    """'matmul_v2, softmax' or a list -> a set of op names (None: paddle's default lists)."""
    if not value:
        return None
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    return {s.strip() for s in items if s.strip()}


class _GradsView:
    """What GradScaler._unscale (and fleet.distributed_scaler's replacement) reads from an
    optimizer: _param_groups whose params hold .grad. The Trainer's gradients are explicit tensors
    (after its data-parallel reduction), so they are shown to the scaler this way; the scaler
    unscales them in place (check_finite_and_unscale) and sets its _found_inf."""

    class _Holder:
        def __init__(self, g):
            self.grad, self.main_grad = g, None

        def _grad_ivar(self):
            return self.grad

    def __init__(self, grads):
        self._param_groups = [{"params": [self._Holder(g) for g in grads if g is not None]}]


class Precision:
    """The run's precision: settings, decorate, auto_cast, the fp16 scaler and skipped steps.

    enabled, dtype, level: from runtime.amp_settings (CPU: False, "float32", "O0").
    scaler: paddle.amp.GradScaler under fp16 (fleet.distributed_scaler over it with several ranks,
    so every rank agrees on a skip), else None. consecutive_skips: skipped steps in a row."""

    def __init__(self, args, topo=None):
        self.args = args
        self.enabled, self.dtype, self.level = amp_settings(args.fp16, args.bf16, args.fp16_opt_level)
        if self.enabled:
            check_supported(self.dtype)
        self.white = _op_list(getattr(args, "amp_custom_white_list", None))
        self.black = _op_list(getattr(args, "amp_custom_black_list", None))
        self.skip_limit = int(getattr(args, "amp_skip_limit", 20))
        self.consecutive_skips = 0
        self.decorated = False
        self.agree_over_world = False
        self.scaler = self._make_scaler(topo) if self.enabled and self.dtype == "float16" else None

    @property
    def o2(self):
        return self.enabled and self.level == "O2"

    def decorate(self, model):
        """O2: the model's parameters cast to the compute dtype in place (float32 islands kept);
        O1 leaves weights float32 (paddle's decorate returns at once for O1). Called once, before
        the optimizer is built (module docstring)."""
        if not self.o2 or self.decorated:
            return model
        paddle.amp.decorate(models=model, level="O2", dtype=self.dtype,
                            master_grad=bool(self.args.amp_master_grad),
                            excluded_layers=float32_layers(model))
        self.decorated = True
        return model

    def autocast(self):
        return paddle.amp.auto_cast(enable=self.enabled, custom_white_list=self.white,
                                    custom_black_list=self.black, level=self.level, dtype=self.dtype)

    def _make_scaler(self, topo):
        a = self.args
        if topo is not None and topo.degrees.get("pp", 1) > 1:
            raise ArgumentError("'fp16' with pipeline_parallel_degree > 1: the pipeline schedule does "
                                "not scale its loss here; use bf16 (no loss scaling needed)")
        scaler = paddle.amp.GradScaler(
            init_loss_scaling=a.scale_loss, incr_ratio=a.amp_incr_ratio, decr_ratio=a.amp_decr_ratio,
            incr_every_n_steps=a.amp_incr_every_n_steps,
            decr_every_n_nan_or_inf=a.amp_decr_every_n_nan_or_inf)
        if scaler.is_enable() and list(scaler._scale.shape) == [1]:
            # paddle 3.3.1's GradScaler._update prints float(self._scale) when it lowers the scale;
            # with numpy >= 2.3 float() of a [1] tensor raises (only 0-d converts), so the first
            # lowering would crash the run: the same value held as a 0-d tensor (tests/test_amp.py)
            scaler._scale = scaler._scale.reshape([])
        self.agree_over_world = False
        if topo is not None and topo.world_size > 1:
            from paddle.distributed import fleet

            if getattr(fleet.fleet, "_hcg", None) is not None:   # fleet.init ran (hybrid topology)
                # found-inf all-reduced (MAX) over the ranks in its _unscale (pure data parallel:
                # left as is, since the gradients it sees are reduced already, as ours are)
                scaler = fleet.distributed_scaler(scaler)
            else:   # no fleet topology: the same MAX all-reduce, done in unscale()
                self.agree_over_world = True
        return scaler

    def scale(self, loss):
        """The loss to back-propagate: loss * scale under fp16, else loss."""
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, grads):
        """fp16: divide the gradients by the scale in place; True when one holds inf / nan (on
        any rank). Host syncs: one, reading found_inf (the step must know whether to update).
        Without a scaler: False, no sync."""
        if self.scaler is None:
            return False
        view = _GradsView(grads)
        self.scaler._unscale(view)
        found_inf = self.scaler._found_inf
        if self.agree_over_world:   # every rank skips or none (fleet.distributed_scaler's rule)
            import paddle.distributed as dist

            found_inf = found_inf.astype("int32")
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        found = bool(found_inf.numpy().any())   # the one host sync per step under fp16 (see above)
        self.scaler._cache_found_inf = found
        return found

    def scale_value(self):
        """The current loss scale, a float (a host read: logging steps and skipped steps only)."""
        return float(self.scaler._scale.numpy().reshape(-1)[0])

    def after_step(self, found, step):
        """Update the scale after a step; on a skipped step log it and stop the run after
        skip_limit consecutive skips or a scale below 1 (reading the scale: a sync on skipped
        steps only). Returns the scale after the update (None when no step was skipped)."""
        if self.scaler is None:
            return None
        self.scaler.update()
        if not found:
            self.consecutive_skips = 0
            return None
        self.consecutive_skips += 1
        scale = self.scale_value()
        logger.warning("step %d skipped: fp16 gradients overflowed (inf/nan); loss scale now %g "
                       "(%d skipped in a row, limit amp_skip_limit=%d)", step, scale,
                       self.consecutive_skips, self.skip_limit)
        if self.consecutive_skips >= self.skip_limit or scale < 1.0:
            why = (f"{self.consecutive_skips} consecutive steps skipped" if scale >= 1.0
                   else f"the loss scale fell to {scale:g} (< 1)")
            raise FloatingPointError(
                f"training diverged at step {step} under fp16: {why}, the gradients overflow at any "
                "scale. Lower learning_rate, use bf16, or raise amp_skip_limit; the last checkpoint "
                "(if any) is still valid")
        return scale


def check_supported(dtype, capability=None):
    """Raise ArgumentError with one line when the GPU cannot run `dtype` (paddle's decorate would
    silently return the model unchanged). capability: (major, minor), default the current GPU's."""
    msg = amp_unsupported(dtype, capability)
    if msg:
        raise ArgumentError(msg)
