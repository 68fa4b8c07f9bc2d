"""Smallest reproduction of the DygraphShardingOptimizerV2 gap (paddle 3.3.1, one process, any device).

    python tools/probes/fake_empty_grad_repro.py

V2 (split_param) links every parameter's .grad to a slice of one fused buffer
(tensor_fusion_helper.py:281-285, `_copy_gradient_from`) and reduce-scatters that buffer. Its
clear_grad, for a parameter without main_grad, calls `p.clear_gradient(True)`
(dygraph_sharding_optimizer.py:988). That zeroes the grad in place but also marks the leaf's
accumulation node "fake empty", so the next backward *replaces* p.grad by a new tensor instead
of adding into it. From the second step on the fused buffer holds zeros: V2 reduce-scatters
zeros and AdamW steps on its moments alone. `p.grad.zero_()` under no_grad (what V1 does for its
own fused buffer, dygraph_sharding_optimizer.py:229-231) keeps the link.
"""
import paddle


def main():
    p = paddle.create_parameter([4], "float32")
    buf = paddle.zeros([8], "float32")
    p._copy_gradient_from(buf._slice(0, 4))                 # what V2 does at construction
    (p * 1.0).sum().backward()
    print("step 1: grad in buffer:", p.grad._is_shared_buffer_with(buf), " buffer:", buf.numpy()[:4])
    p.clear_gradient(True)                                  # V2.clear_grad without main_grad
    (p * 2.0).sum().backward()
    print("step 2 after clear_gradient(True): grad in buffer:", p.grad._is_shared_buffer_with(buf),
          " grad:", p.grad.numpy(), " buffer:", buf.numpy()[:4])

    q = paddle.create_parameter([4], "float32")
    buf2 = paddle.zeros([8], "float32")
    q._copy_gradient_from(buf2._slice(0, 4))
    (q * 1.0).sum().backward()
    with paddle.no_grad():
        q.grad.zero_()                                      # the in-place alternative
    (q * 2.0).sum().backward()
    print("step 2 after grad.zero_():         grad in buffer:", q.grad._is_shared_buffer_with(buf2),
          " grad:", q.grad.numpy(), " buffer:", buf2.numpy()[:4])


if __name__ == "__main__":
    main()
