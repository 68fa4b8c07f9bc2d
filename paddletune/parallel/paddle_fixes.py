"""Fixes of paddle bugs that hit every build (CPU and CUDA alike), each applied to one object,
each pinned to the paddle source it corrects (a fingerprint of the method it replaces: when paddle
changes it, `install_*` refuses and tests/test_paddle_fixes.py fails, so the fix is re-checked
rather than silently applied to different code). CPU-only workarounds live in cpu_compat.py.

1. DygraphShardingOptimizerV2.clear_grad (fleet's sharding stage 1 with `split_param`, paddle
   3.3.1, dygraph_sharding_optimizer.py:965-996). V2 links every parameter's .grad to a slice of
   one fused buffer per dtype (tensor_fusion_helper.py:281-285, `_copy_gradient_from`) and
   reduce-scatters that buffer in its step. Its clear_grad calls `p.clear_gradient(True)` on a
   parameter without `main_grad`; that zeroes the gradient but also marks the leaf's gradient
   accumulation "fake empty", so the next backward puts the gradient in a NEW tensor instead of
   adding into the buffer. From the second step on V2 reduce-scatters zeros and AdamW moves on
   its moments alone (1.4e-2 from one process after step 2 in the probe). Every float32 run is
   hit (PaddleNLP's bf16 runs carry main_grad, which V2 zeroes in place). The fix zeroes each
   gradient in place, as V1 does for its own fused buffer (:229-231). docs/notes/sharding_v2.md
   has the finding and tools/probes/fake_empty_grad_repro.py the smallest reproduction.
"""
import hashlib
import inspect
import types

import paddle

# sha256 (first 16 hex digits) of inspect.getsource of the method each fix replaces, paddle 3.3.1
V2_CLEAR_GRAD_SHA = "7c82127367491d04"


def fingerprint(fn):
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def _v2_class():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import \
        DygraphShardingOptimizerV2

    return DygraphShardingOptimizerV2


def v2_clear_grad_is_paddles():
    """Whether DygraphShardingOptimizerV2.clear_grad is still paddle 3.3.1's (the one fixed)."""
    return fingerprint(_v2_class().clear_grad) == V2_CLEAR_GRAD_SHA


def _clear_grad_in_place(self, set_to_zero=True):
    """V2.clear_grad with every gradient zeroed in place (main_grad as paddle does; .grad with
    zero_() instead of clear_gradient(True), which would cut it off V2's fused buffer). Releasing
    gradients (set_to_zero False / release_gradients) keeps paddle's own code."""
    if not set_to_zero or self.sd_release_grads:
        return type(self).clear_grad(self, set_to_zero)
    with paddle.no_grad():
        for p in self._parameter_list:
            g = p.main_grad if hasattr(p, "main_grad") else p.grad
            if g is not None:
                g.zero_()


def fix_v2_clear_grad(sharded):
    """Give fleet's DygraphShardingOptimizerV2 instance `sharded` the in-place clear_grad (the
    class is left alone). Refuses (RuntimeError) when paddle's method is not the one fixed."""
    cls = _v2_class()
    if not isinstance(sharded, cls):
        raise TypeError(f"expected a DygraphShardingOptimizerV2, got {type(sharded).__name__}")
    if not v2_clear_grad_is_paddles():
        raise RuntimeError(
            "paddle's DygraphShardingOptimizerV2.clear_grad is not the one paddletune fixes "
            f"(fingerprint {fingerprint(cls.clear_grad)}, fixed: {V2_CLEAR_GRAD_SHA}); re-check "
            "docs/notes/sharding_v2.md with tools/probes/fake_empty_grad_repro.py and update "
            "parallel/paddle_fixes.py")
    sharded.clear_grad = types.MethodType(_clear_grad_in_place, sharded)
    return sharded
