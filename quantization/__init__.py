"""int8 weights and int8 KV: an offline params transform plus the matching runtime ops."""

from quantization.int8 import Int8Weight
from quantization.kv import dequantize_kv, quantize_kv
from quantization.ops import linear
from quantization.weights import MODES, QuantizedWeight, quantize_weight, weight_bytes

__all__ = [
    "Int8Weight",
    "MODES",
    "QuantizedWeight",
    "dequantize_kv",
    "linear",
    "quantize_kv",
    "quantize_weight",
    "weight_bytes",
]
