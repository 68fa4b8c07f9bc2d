"""paddle's fp16 GradScaler on a CPU build, for tests: GradScaler disables itself unless the
tracer's place is a GPU (amp/grad_scaler.py); `real_fp16_scaler` builds paddle's real scaler
through Precision._make_scaler with only that place check answered as a GPU would. The compute
stays float32 (CPU has no fp16 matmul); the scaler's arithmetic is paddle's own."""
import sys


class _GpuPlace:
    def is_gpu_place(self):
        return True


def real_fp16_scaler(precision, topo=None):
    """precision._make_scaler(topo) with GradScaler's place check faked during construction."""
    gs = sys.modules["paddle.amp.grad_scaler"]
    real = gs._dygraph_tracer

    class Tracer:
        _expected_place = _GpuPlace()

        def __getattr__(self, key):
            return getattr(real(), key)

    gs._dygraph_tracer = lambda: Tracer()
    try:
        return precision._make_scaler(topo)
    finally:
        gs._dygraph_tracer = real
