"""The cuBLASLt FP8 path (`scaled_mm_w8a8`): which layouts it serves, and its products against the W8A8 reference.

`torch._scaled_mm` also runs on the CPU (row-wise scales, bfloat16 out), so the wrapper is checked here against
`w8a8_linear_reference` for the pairings it serves (per-token x per-channel, per-tensor x per-tensor, with bias,
odd M); on the GPU the same comparison runs at the Qwen3-8B shapes (tests/gpu/test_quantization_gpu.py). Block
layouts must never reach it: their several K scales have no row-wise form (a control shows that routing one there
gives the wrong product).
"""

from __future__ import annotations

import pytest
import torch
from helpers.fp8_cases import CONFIGS, fp8_case, fp8_layer, fp8_x

from framework.layers.quantization import fp8 as fp8_module
from framework.layers.quantization.scaled_mm_w8a8 import scaled_mm_applies, scaled_mm_layout, w8a8_linear_scaled_mm
from framework.layers.quantization.triton_w8a8 import quantize_fp8_groups_reference, w8a8_linear_reference


def _rms(t: torch.Tensor) -> float:
    return t.float().pow(2).mean().sqrt().item()


@pytest.mark.parametrize("name", ["channel", "tensor"])
@pytest.mark.parametrize("m", [2, 3, 70])
def test_scaled_mm_matches_the_w8a8_reference(name: str, m: int) -> None:
    xq, sx, gx, w, sw, gn, gk = fp8_case(name, m)
    assert scaled_mm_layout(w, sw, gx)
    bias = torch.randn(w.shape[0]).bfloat16()
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16, bias)
    out = w8a8_linear_scaled_mm(xq, sx, w, sw, bias)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=2**-7 * _rms(ref))


def test_layouts_row_wise_scales_cannot_express_are_refused() -> None:
    """Block scales (several per K), activation groups narrower than K and unaligned shapes go to `triton_w8a8`;
    CPU tensors and 16-bit types other than bfloat16 never take the cuBLASLt path."""
    xq, sx, gx, w, sw, gn, gk = fp8_case("block", 3)
    assert not scaled_mm_layout(w, sw, gx)  # [2, 2] block grid, 128-input activation groups
    _, _, _, wc, swc, _, k = fp8_case("channel", 3)
    assert scaled_mm_layout(wc, swc, k) and not scaled_mm_layout(wc, swc, k // 2)
    assert not scaled_mm_layout(wc[:, :200], swc, 200)  # K = 200: not a multiple of 16
    assert not scaled_mm_layout(wc[:150], swc[:150], k)  # N = 150
    assert not scaled_mm_applies(torch.zeros(3, k, dtype=torch.bfloat16), wc, swc, k)  # the CPU


def test_block_scales_routed_to_scaled_mm_would_be_wrong() -> None:
    """Control: feeding a block layout's first scale column to the row-wise path moves the product out of the
    tolerance above, so `scaled_mm_layout` refusing it is what keeps block checkpoints right."""
    xq, sx, gx, w, sw, gn, gk = fp8_case("block", 3)
    ref = w8a8_linear_reference(xq, sx, gx, w, sw, gn, gk, torch.bfloat16)
    n = w.shape[0]
    row_scale = sw[:, :1].repeat_interleave(gn, 0)[:n]
    wrong = w8a8_linear_scaled_mm(xq, sx[:, :1].contiguous(), w, row_scale)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(wrong.float(), ref.float(), rtol=2**-7, atol=2**-7 * _rms(ref))


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor"])
def test_the_linear_method_routes_served_layouts_to_scaled_mm(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the device check passed (as on an H100), a per-channel or per-tensor FP8 layer's large batches run
    through `w8a8_linear_scaled_mm` and equal the W8A8 reference of the checkpoint's activation scheme."""
    calls: list[tuple[int, ...]] = []

    def served(x: torch.Tensor, weight: torch.Tensor, sw: torch.Tensor, group_x: int) -> bool:
        calls.append(tuple(x.shape))
        return scaled_mm_layout(weight, sw, group_x)

    monkeypatch.setattr(fp8_module, "scaled_mm_applies", served)
    config, activation, group_x = CONFIGS[fmt]
    layer, method = fp8_layer(config)
    x = fp8_x(130, 256).bfloat16()
    y = method.apply(layer, x, None)  # type: ignore[attr-defined]
    assert calls == [(130, 256)]
    if activation == "static":
        xq, sx = fp8_module.quantize_fp8_static(x, layer.input_scale)
    else:
        xq, sx = quantize_fp8_groups_reference(x, group_x)
    groups = method.groups(layer)  # type: ignore[attr-defined]
    expected = w8a8_linear_reference(xq, sx, group_x, layer.weight, method.scale_grid(layer), *groups, x.dtype)  # type: ignore[attr-defined]
    torch.testing.assert_close(y.float(), expected.float(), rtol=2**-7, atol=2**-7 * _rms(expected))
