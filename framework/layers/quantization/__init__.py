"""Quantized linear layers: the `QuantMethod` interface, the FP8 and INT4 methods and their kernels, and the choice
of a method per layer from a checkpoint's quantization config (see docs/quantization.md)."""

from __future__ import annotations

from framework.layers.quantization.base import QuantizationError, QuantMethod
from framework.layers.quantization.config import QUANT_FORMATS, SUPPORTED, QuantScheme, quant_scheme
from framework.layers.quantization.model_pass import (
    finish_quantization,
    is_quantized,
    quantize_linears,
    set_activation_quantization,
)

__all__ = [
    "QUANT_FORMATS",
    "SUPPORTED",
    "QuantMethod",
    "QuantScheme",
    "QuantizationError",
    "finish_quantization",
    "is_quantized",
    "quant_scheme",
    "quantize_linears",
    "set_activation_quantization",
]
