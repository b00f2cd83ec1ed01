"""FP8 activation quantization and the FP8 x FP8 GEMM against their references (interpreter on the CPU).

The activation quantization's reference is checked against the `compressed-tensors` library's own dynamic FP8
quantization (per token: FP8_DYNAMIC; per token and 128-input group: block FP8), so the scale convention (amax /
448) and the rounding are those of the checkpoints' producers. The GEMM kernel covers the three pairings of
activation and weight scales (token groups x 128 blocks, token x channel, static tensor x tensor), partial tiles
in every dimension, and a control: the activation scales of the neighbouring group move the output out of tolerance.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.quantization.fp8 import quantize_fp8_per_channel
from framework.layers.quantization.triton_w8a8 import (
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    quantize_fp8_static,
    w8a8_linear_reference,
    w8a8_linear_triton,
)


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    x[1, :] = 0  # an all-zero row (scale 1)
    return x


@pytest.mark.parametrize("strategy,group", [("token", 256), ("group", 128)])
def test_activation_quantization_matches_compressed_tensors(strategy: str, group: int) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    x = _x(5, 256) + 0.01  # no zero row: the library divides by a zero amax
    extra = {"group_size": group} if strategy == "group" else {}
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=True, symmetric=True, **extra)
    value = x.unsqueeze(0) if strategy == "token" else x  # the library's token strategy reads [batch, seq, hidden]
    scale, zero = compute_dynamic_scales_and_zp(value, args, module=None)
    expected = fake_quantize(value, scale, zero, args).reshape(x.shape)
    q, s = quantize_fp8_groups_reference(x, group)
    assert torch.equal(q.float().view(5, -1, group) * s.unsqueeze(-1), expected.view(5, -1, group))


@pytest.mark.parametrize("group", [64, 96, 128, 192])
def test_activation_quantization_kernel(group: int) -> None:
    x = _x(4, 192)  # a partial last group with 128; 96 and 192 (per token) are not powers of two
    x[:, 100] = 50.0  # the largest value just past a group of 96: a program reading past its group is caught
    x = x.bfloat16()
    q, s = quantize_fp8_groups(x, group, use_kernel=True)
    q_ref, s_ref = quantize_fp8_groups_reference(x, group)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # Triton's interpreter rounds float32 -> e4m3 wrongly (124.3 -> 64), so the FP8 values themselves are compared
    # on the GPU (tests/gpu/test_quantization_gpu.py); here only their signs and the zero row.
    assert torch.equal(torch.sign(q.float()), torch.sign(q_ref.float()))


def _block_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 16).to(torch.float8_e4m3fn)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 0.01 + 0.001


def _case(name: str, m: int) -> tuple:  # type: ignore[type-arg]
    """(xq, sx, group_x, weight, sw, group_n, group_k) for one pairing of scales."""
    n, k = 160, 256
    x = _x(m, k, seed=m)
    if name == "block":
        w, sw = _block_weight(n, k, 1)
        return (*quantize_fp8_groups_reference(x, 128), 128, w, sw, 128, 128)
    if name == "channel":
        w, sw = quantize_fp8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(2)))
        return (*quantize_fp8_groups_reference(x, k), k, w, sw, 1, k)
    w, sw = quantize_fp8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(3)).view(1, -1))
    return (*quantize_fp8_static(x, torch.tensor([0.05])), k, w.view(n, k), sw.view(1, 1), n, k)


@pytest.mark.parametrize("name", ["block", "channel", "tensor"])
@pytest.mark.parametrize("m", [3, 70])
def test_w8a8_kernel_matches_reference(name: str, m: int) -> None:
    xq, sx, gx, w, sw, gn, gk = _case(name, m)
    bias = torch.randn(w.shape[0]).bfloat16()
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16, bias)
    out = w8a8_linear_triton(xq, sx.contiguous(), gx, w, sw.contiguous(), gn, gk, torch.bfloat16, bias, upcast=True)
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7 * scale)


def test_neighbouring_activation_group_is_detected() -> None:
    """Control: a kernel reading the wrong K group's activation scales would be caught by the tolerance above."""
    xq, sx, gx, w, sw, gn, gk = _case("block", 3)
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16)
    wrong = w8a8_linear_reference(xq, sx.roll(1, dims=1), gx, w, sw, gn, gk, torch.bfloat16)
    scale = ref.float().pow(2).mean().sqrt().item()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong.float(), ref.float(), rtol=2**-7, atol=2**-7 * scale)


def _fp8_layer(config: dict, n: int = 160, k: int = 256) -> tuple[torch.nn.Linear, object]:  # type: ignore[type-arg]
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


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_large_batches_quantize_activations_as_the_checkpoint_declares(fmt: str) -> None:
    """From `w8a8_min_tokens` rows on, a layer runs the W8A8 path with the checkpoint's activation scheme; below,
    W8A16 (the dequantized weight's product). Each is compared with its reference, and they differ."""
    config, activation, group_x = CONFIGS[fmt]
    layer, method = _fp8_layer(config)
    assert method.activation == activation and method.w8a8_min_tokens == 128  # type: ignore[attr-defined]
    x = _x(130, 256).bfloat16()
    y = method.apply(layer, x, None)  # type: ignore[attr-defined]
    if activation == "static":
        xq, sx = quantize_fp8_static(x, layer.input_scale)
    else:
        xq, sx = quantize_fp8_groups_reference(x, group_x)
    groups = method.groups(layer)  # type: ignore[attr-defined]
    expected = w8a8_linear_reference(xq, sx, group_x, layer.weight, method.scale_grid(layer), *groups, x.dtype)  # type: ignore[attr-defined]
    scale = expected.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=2**-7 * scale)
    small = method.apply(layer, x[:4].float(), None)  # float32: the interpreter's bfloat16 tl.dot is unusable
    w16 = x[:4].float() @ method.dequantized_weight(layer).t()  # type: ignore[attr-defined]
    torch.testing.assert_close(small.float(), w16, rtol=2**-7, atol=2**-7 * scale)
    assert not torch.allclose(y[:4].float(), w16, rtol=2**-9, atol=2**-9 * scale)  # the two paths are told apart
