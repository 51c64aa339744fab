"""kvarn: KVarN KV-cache quantization (Hadamard rotation, Sinkhorn variance normalization, 4/2-bit RTN).

``import kvarn`` needs torch alone; Triton, vLLM and transformers are imported only when used.
"""

from kvarn.api import QuantizedKV, QuantizedTensor, dequantize, quantize
from kvarn.config import DEFAULT_PRESET, PRESETS, KVarNConfig, LayerPolicy, recommended_preset

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "KVarNConfig",
    "LayerPolicy",
    "QuantizedKV",
    "QuantizedTensor",
    "__version__",
    "dequantize",
    "quantize",
    "recommended_preset",
]
