"""One tensor-parallel rank's INT4 layout on one GPU: the W4A16 kernel over the row-parallel rank layouts at the
Qwen3-8B projections' input sizes (o_proj K = 4096, down_proj K = 12288), with group 128 and a random act-order
permutation (runs padded to the unit that reads the fewest bytes, activations gathered through `perm`) or a split
in the middle of a group. Claim: the rank's product equals the reference on the same layout up to one bf16
rounding step, and the layout's dequantized weight is the rank's part of the layer's.

Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_quant_rank_layout_gpu.py` (seconds; one GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 is set: GPU kernels would be interpreted", allow_module_level=True)

from framework.layers.quantization.int4_parallel import gather_input, rank_group_layout  # noqa: E402
from framework.layers.quantization.triton_w4a16 import (  # noqa: E402
    pack_rows,
    w4a16_linear_reference,
    w4a16_linear_triton,
)


@pytest.mark.parametrize("k, tp, act_order", [(4096, 2, True), (12288, 2, True), (12288, 8, True), (11008, 4, False)])
@pytest.mark.parametrize("m", [1, 16, 512])
def test_w4a16_kernel_on_a_row_parallel_rank_layout(k: int, tp: int, act_order: bool, m: int) -> None:
    n, group, rank = 4096, 128, tp - 1
    g = torch.Generator(device="cuda").manual_seed(k + tp + m)
    order = torch.randperm(k, device="cuda", generator=g) if act_order else torch.arange(k, device="cuda")
    per = k // tp
    col_group = (torch.argsort(order) // group)[rank * per : (rank + 1) * per]
    q = torch.randint(0, 16, (n, per), device="cuda", generator=g, dtype=torch.uint8)
    scales = torch.rand((n, k // group), device="cuda", generator=g) * 0.01 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), device="cuda", generator=g).float()
    q2, s2, z2, perm, unit = rank_group_layout(q, col_group, scales, zeros, group)
    assert unit % 16 == 0 and (perm is not None) == act_order
    x = torch.randn((m, per), device="cuda", generator=g).bfloat16()
    xs = x if perm is None else gather_input(x, perm)
    out = w4a16_linear_triton(xs, pack_rows(q2), s2.contiguous(), z2.contiguous(), unit)
    ref = w4a16_linear_reference(xs, pack_rows(q2), s2, z2, unit)
    ulp = 2**-7
    torch.testing.assert_close(out, ref, rtol=ulp, atol=ulp * ref.float().abs().mean().item())
    # the layout means the rank's own weights: x @ (s[g(k)] * (q - z[g(k)]))^T in float32
    want = x.float() @ (scales[:, col_group] * (q.float() - zeros[:, col_group])).t()
    torch.testing.assert_close(ref.float(), want, rtol=ulp, atol=ulp * want.abs().mean().item())
