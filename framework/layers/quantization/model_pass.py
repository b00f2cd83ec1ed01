"""Give a model's linear layers their quantized methods (at build) and finish them (after the weights are read)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from framework.layers.parallel.linear import ColumnParallelLinear, RowParallelLinear
from framework.layers.quantization.base import QuantizationError, QuantMethod
from framework.layers.quantization.config import QuantScheme
from framework.layers.quantization.moe import MoeQuantMethod, moe_method


def quantize_linears(model: nn.Module, scheme: QuantScheme) -> int:
    """Give every column- / row-parallel linear layer of `model` that `scheme` quantizes its method and the
    checkpoint's tensor layout (call on the meta-device build, before the weights are allocated); returns how many.
    A stacked-experts module (`stacked_experts = True`: `gate_up_proj [E, 2, I, H]`, `down_proj [E, H, I]`) takes
    the experts' variant of the method its first expert's `gate_proj` would get (`layers/quantization/moe.py`)."""
    count = 0
    for prefix, module in model.named_modules():
        experts = bool(getattr(module, "stacked_experts", False))
        if not experts and not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            continue
        method: Optional[QuantMethod] = scheme.method_for(f"{prefix}.0.gate_proj" if experts else prefix)
        if method is None:
            continue
        allowed = getattr(module, "quant_formats", None)  # experts that read only some formats name them
        if experts and allowed is not None and scheme.format not in allowed:
            reads = f"read {', '.join(allowed)} weights" if allowed else "have no quantized layout (16-bit only)"
            raise QuantizationError(f"{prefix}: these experts {reads}, not {scheme.format}")
        if experts:
            method = moe_method(method, prefix)
        method.create_weights(module, prefix)
        module.quant_method = method
        module.kernel_backend = "auto"  # type: ignore[attr-defined]  # set_kernel_backend hands down the config's
        count += 1
    return count


def finish_quantization(model: nn.Module) -> None:
    """Run each quantized layer's `process_after_loading` (once the checkpoint's tensors are in)."""
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_after_loading(module, prefix)


def set_activation_quantization(model: nn.Module, dense: Optional[int], experts: Optional[int]) -> None:
    """Give every quantized layer whose method can quantize activations (`w8a8_min_tokens`) the token count from
    which it does: `dense` for linear layers (`model.fp8_activation_min_tokens`), `experts` for stacked experts
    (`model.fp8_moe_activation_min_tokens`); None: never."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "w8a8_min_tokens"):
            method.w8a8_min_tokens = experts if isinstance(method, MoeQuantMethod) else dense


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` (a linear layer) runs a quantized method."""
    return getattr(module, "quant_method", None) is not None
