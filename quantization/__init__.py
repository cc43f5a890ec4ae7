"""Weight formats per backend (group-wise int8 for CPU, int8 for TPU/GPU, XLA:CPU's stacked forms) and
the one linear-weight op the models call (quantization.ops). The int8 KV format is the attention
kernels' (kernels.attention.quantize_kv)."""

from slipstream.quantization.int8 import Int8Weight
from slipstream.quantization.ops import linear
from slipstream.quantization.weights import MODES, QuantizedWeight, quantize_weight, weight_bytes

__all__ = [
    "Int8Weight",
    "MODES",
    "QuantizedWeight",
    "linear",
    "quantize_weight",
    "weight_bytes",
]
