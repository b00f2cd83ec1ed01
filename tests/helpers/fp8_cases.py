"""FP8 test cases shared by the W8A8 kernel tests: activations, weights with each scale layout, and FP8 layers
built from a checkpoint's quantization_config."""

from __future__ import annotations

import torch

from framework.layers.quantization.fp8 import quantize_fp8_per_channel
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups_reference, quantize_fp8_static


def fp8_x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[min(1, m - 1), :] = 0  # an all-zero row (scale 1)
    return x


def block_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.001


def fp8_case(name: str, m: int) -> tuple:  # type: ignore[type-arg]
    """(xq, sx, group_x, weight, sw, group_n, group_k) for one pairing of scales."""
    n, k = 160, 256
    x = fp8_x(m, k, seed=m)
    if name == "block":
        w, sw = block_weight(n, k, 1)
        return (*quantize_fp8_groups_reference(x, 128), 128, w, sw, 128, 128)
    if name == "channel":
        w, sw = quantize_fp8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(2)))
        return (*quantize_fp8_groups_reference(x, k), k, w, sw, 1, k)
    w, sw = quantize_fp8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(3)).view(1, -1))
    return (*quantize_fp8_static(x, torch.tensor([0.05])), k, w.view(n, k), sw.view(1, 1), n, k)


def fp8_layer(config: dict, n: int = 160, k: int = 256) -> tuple[torch.nn.Linear, object]:  # type: ignore[type-arg]
    """A linear layer given the method `config` (a checkpoint's quantization_config) picks, filled at random."""
    from framework.layers.quantization.config import quant_scheme

    method = quant_scheme({"quantization_config": config}).method_for("model.layers.0.mlp.down_proj")  # type: ignore[union-attr]
    layer = torch.nn.Linear(k, n, bias=False)
    method.create_weights(layer, "down_proj")  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.weight.copy_((torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn))
        scale = getattr(layer, method.scale_name)  # type: ignore[union-attr]
        scale.copy_(torch.rand(scale.shape, generator=g) * 0.01 + 0.001)
        if hasattr(layer, "input_scale"):
            layer.input_scale.fill_(0.05)
    layer.kernel_backend = "triton"  # type: ignore[assignment]
    return layer, method


CT_GROUP = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}}
CONFIGS = {
    "fp8-block": ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "group", 128),
    "ct-channel": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "channel"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": True, "strategy": "token"}}}},
        "token", 256,
    ),
    "ct-tensor": (
        {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
            **CT_GROUP, "weights": {**CT_GROUP["weights"], "strategy": "tensor"},
            "input_activations": {"num_bits": 8, "type": "float", "dynamic": False, "strategy": "tensor"}}}},
        "static", 256,
    ),
}  # fmt: skip
