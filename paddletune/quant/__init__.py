"""Low-bit frozen backbones: weight-only int8 / int4 / nf4 / fp4 (see weight_only.py)."""
from .model import (block_axis_for, format_report, quant_config, quant_report,  # noqa: F401
                    quantize_model, quantize_model_lazily, quantized_layers)
from .weight_only import (ALGORITHMS, FP4, FP4_E2M1, INT4, NF4, QuantConfig,  # noqa: F401
                          QuantizedLinear, pack_nibbles, quantize_weight, slice_state,
                          state_shapes, unpack_nibbles)
