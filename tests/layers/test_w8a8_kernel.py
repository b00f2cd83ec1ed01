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
from helpers.fp8_cases import CONFIGS, fp8_case, fp8_layer, fp8_x

from framework.layers.quantization.triton_w8a8 import (
    quantize_fp8_groups,
    quantize_fp8_groups_reference,
    quantize_fp8_static,
    w8a8_linear_reference,
    w8a8_linear_triton,
)


@pytest.mark.parametrize("strategy,group", [("token", 256), ("group", 128)])
def test_activation_quantization_matches_compressed_tensors(strategy: str, group: int) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    x = fp8_x(5, 256) + 0.01  # no zero row: the library divides by a zero amax
    extra = {"group_size": group} if strategy == "group" else {}
    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=True, symmetric=True, **extra)
    value = x.unsqueeze(0) if strategy == "token" else x  # the library's token strategy reads [batch, seq, hidden]
    scale, zero = compute_dynamic_scales_and_zp(value, args, module=None)
    expected = fake_quantize(value, scale, zero, args).reshape(x.shape)
    q, s = quantize_fp8_groups_reference(x, group)
    assert torch.equal(q.float().view(5, -1, group) * s.unsqueeze(-1), expected.view(5, -1, group))


@pytest.mark.parametrize("group", [64, 96, 128, 192])
def test_activation_quantization_kernel(group: int) -> None:
    x = fp8_x(4, 192)  # a partial last group with 128; 96 and 192 (per token) are not powers of two
    x[:, 100] = 50.0  # the largest value just past a group of 96: a program reading past its group is caught
    x = x.bfloat16()
    q, s = quantize_fp8_groups(x, group, use_kernel=True)
    q_ref, s_ref = quantize_fp8_groups_reference(x, group)
    torch.testing.assert_close(s, s_ref, rtol=0, atol=0)
    # Triton's interpreter rounds float32 -> e4m3 wrongly (124.3 -> 64), so the FP8 values themselves are compared
    # on the GPU (tests/gpu/test_quantization_gpu.py); here only their signs and the zero row.
    assert torch.equal(torch.sign(q.float()), torch.sign(q_ref.float()))


@pytest.mark.parametrize("name", ["block", "channel", "tensor"])
@pytest.mark.parametrize("m", [3, 70])
def test_w8a8_kernel_matches_reference(name: str, m: int) -> None:
    xq, sx, gx, w, sw, gn, gk = fp8_case(name, m)
    bias = torch.randn(w.shape[0]).bfloat16()
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16, bias)
    out = w8a8_linear_triton(xq, sx.contiguous(), gx, w, sw.contiguous(), gn, gk, torch.bfloat16, bias, upcast=True)
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7 * scale)


def test_neighbouring_activation_group_is_detected() -> None:
    """Control: a kernel reading the wrong K group's activation scales would be caught by the tolerance above."""
    xq, sx, gx, w, sw, gn, gk = fp8_case("block", 3)
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16)
    wrong = w8a8_linear_reference(xq, sx.roll(1, dims=1), gx, w, sw, gn, gk, torch.bfloat16)
    scale = ref.float().pow(2).mean().sqrt().item()
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong.float(), ref.float(), rtol=2**-7, atol=2**-7 * scale)


@pytest.mark.parametrize("fmt", sorted(CONFIGS))
def test_large_batches_quantize_activations_as_the_checkpoint_declares(fmt: str) -> None:
    """From `w8a8_min_tokens` rows on, a layer runs the W8A8 path with the checkpoint's activation scheme; below,
    W8A16 (the dequantized weight's product). Each is compared with its reference, and they differ."""
    config, activation, group_x = CONFIGS[fmt]
    layer, method = fp8_layer(config)
    assert method.activation == activation and method.w8a8_min_tokens == 128  # type: ignore[attr-defined]
    x = fp8_x(130, 256).bfloat16()
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
