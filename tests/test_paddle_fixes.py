"""parallel/paddle_fixes.py: each fix pinned to the paddle method it replaces, and shown against
paddle's own method on the same object (the oracle: what paddle's code does to the gradient)."""
import types

import paddle
import pytest

from paddletune.parallel import paddle_fixes


def _v2():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.dygraph_sharding_optimizer import \
        DygraphShardingOptimizerV2

    return DygraphShardingOptimizerV2


def test_v2_clear_grad_is_still_paddles_3_3_1():
    """Fails when paddle changes DygraphShardingOptimizerV2.clear_grad: then re-check the bug
    (tools/probes/fake_empty_grad_repro.py, docs/notes/sharding_v2.md) and the fix."""
    assert paddle_fixes.v2_clear_grad_is_paddles(), paddle_fixes.fingerprint(_v2().clear_grad)


def _linked_param():
    """A parameter whose .grad is a view of a fused buffer, as V2 links it (tensor_fusion_helper
    `_link_grad_to_buffer`), and a stand-in V2 with the attributes its clear_grad reads."""
    p = paddle.create_parameter([4], "float32")
    buf = paddle.zeros([8], "float32")
    p._copy_gradient_from(buf._slice(0, 4))
    v2 = types.SimpleNamespace(_parameter_list=[p], sd_release_grads=False, tensor_fusion=False,
                               pp_overlap=False, _comm_buffer_list=[])
    return p, buf, v2


def test_paddles_v2_clear_grad_cuts_the_grad_off_its_buffer_and_the_fix_does_not():
    p, buf, v2 = _linked_param()
    (p * 1.0).sum().backward()
    _v2().clear_grad(v2)                               # paddle's method, on a V2-shaped object
    (p * 2.0).sum().backward()
    assert not p.grad._is_shared_buffer_with(buf)      # the bug: the next grad left the buffer
    assert buf.numpy()[:4].tolist() == [0.0] * 4       # V2 would reduce-scatter these zeros

    q, qbuf, w = _linked_param()
    (q * 1.0).sum().backward()
    paddle_fixes._clear_grad_in_place(w)               # the fix
    (q * 2.0).sum().backward()
    assert q.grad._is_shared_buffer_with(qbuf) and qbuf.numpy()[:4].tolist() == [2.0] * 4
    (q * 3.0).sum().backward()                         # accumulation adds into the buffer
    assert qbuf.numpy()[:4].tolist() == [5.0] * 4


def test_fix_is_per_instance_and_refuses_a_changed_paddle(monkeypatch):
    cls = _v2()
    obj = cls.__new__(cls)                             # (no fleet needed to hold the method)
    before = cls.clear_grad
    paddle_fixes.fix_v2_clear_grad(obj)
    assert obj.clear_grad.__func__ is paddle_fixes._clear_grad_in_place and cls.clear_grad is before
    with pytest.raises(TypeError, match="expected a DygraphShardingOptimizerV2"):
        paddle_fixes.fix_v2_clear_grad(object())

    def changed(self, set_to_zero=True):
        return None
    monkeypatch.setattr(cls, "clear_grad", changed)
    with pytest.raises(RuntimeError, match="not the one paddletune fixes"):
        paddle_fixes.fix_v2_clear_grad(cls.__new__(cls))
