"""The quantized-linear interface: a `QuantMethod` owns one linear layer's checkpoint layout and its matmul.

A method is chosen per layer from the checkpoint's `quantization_config` (`framework.layers.quantization.config`).
It acts in three moments, each once per layer:

1. `create_weights(layer)`, on the meta device while the model is built: replaces the layer's `weight` by the
   tensors the checkpoint holds for it (e.g. an FP8 `weight` and a float32 `weight_scale_inv`), names them in
   `layer.keep_dtype` (the materialiser keeps their dtypes instead of casting to the model dtype) and in
   `layer.shard_dims` (which dimension tensor parallelism splits), so the loader fills them by name;
2. `process_after_loading(layer)`, once the checkpoint is read: checks and converts to the layout `apply` reads;
3. `apply(layer, x, bias)`, every forward: `[M, K] -> [M, N]` in the activation dtype.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Optional

import torch
from torch import nn


class QuantizationError(ValueError):
    """A quantization config or quantized checkpoint that mrv2 refuses; the message names the format or tensor."""


FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


class QuantMethod(ABC):
    """One quantized weight layout and its matmul (see the module docstring for the three moments)."""

    name: ClassVar[str]  # how docs, errors and logs name the layout, e.g. "fp8-block"

    @abstractmethod
    def create_weights(self, layer: nn.Linear, prefix: str) -> None:
        """Replace `layer`'s weight by the checkpoint's tensors (meta device); `prefix` names the layer."""

    def process_after_loading(self, layer: nn.Linear, prefix: str) -> None:
        """Convert the loaded tensors to what `apply` reads (default: nothing to do)."""

    @abstractmethod
    def apply(self, layer: nn.Linear, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x [M, K] (activation dtype) -> x @ W^T + bias [M, N] in x's dtype; W is this rank's part."""

    @abstractmethod
    def dequantized_weight(self, layer: nn.Linear) -> torch.Tensor:
        """This rank's weight as float32 [N, K] (tests, tools; never on the step path)."""


def replace_parameter(layer: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Set `layer.<name>` to a frozen parameter holding `tensor` (a quantized dtype keeps its dtype)."""
    if name in layer._parameters:
        del layer._parameters[name]
    layer.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
    keep = set(getattr(layer, "keep_dtype", ()))
    keep.add(name)
    layer.keep_dtype = frozenset(keep)  # type: ignore[assignment]
