"""Low-bit frozen backbones: weight-only int8 / int4 / nf4 / fp4 (see weight_only.py)."""
from .model import (format_report, quant_config, quant_report, quantize_model,  # noqa: F401
                    quantize_model_lazily, quantized_layers)
from .weight_only import (ALGORITHMS, FP4, FP4_E2M1, INT4, NF4, QuantConfig,  # noqa: F401
                          QuantizedLinear, pack_nibbles, unpack_nibbles)
