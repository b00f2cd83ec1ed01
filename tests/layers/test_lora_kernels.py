"""LoRA shrink / expand: the Triton kernels (interpreter on the CPU) against their PyTorch references, and the
references against a plain per-token loop (each token's x @ A_l^T @ B_l^T, nothing shared between tokens)."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.lora import (
    PER_ROW_MAX_TOKENS,
    LoraPartLayout,
    lora_expand_reference,
    lora_expand_triton,
    lora_shrink_reference,
    lora_shrink_triton,
)


def _case(num_tokens: int, k: int, n: int, rank: int, slots: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=gen).to(dtype)
    a = torch.randn(slots, rank, k, generator=gen).to(dtype) * 0.2
    b = torch.randn(slots, n, rank, generator=gen).to(dtype) * 0.2
    # segments of one adapter each (prefill-like), some without an adapter (-1)
    token_lora = torch.empty(num_tokens, dtype=torch.int32)
    start = 0
    while start < num_tokens:
        length = int(torch.randint(1, 40, (1,), generator=gen))
        token_lora[start : start + length] = int(torch.randint(-1, slots, (1,), generator=gen))
        start += length
    y = torch.randn(num_tokens, n, generator=gen).to(dtype)
    return x, a, b, token_lora, y


def _loop(x, a, b, token_lora, y):  # type: ignore[no-untyped-def]
    out = y.clone()
    for t in range(x.shape[0]):
        slot = int(token_lora[t])
        if slot >= 0:
            delta = (x[t].float() @ a[slot].float().t()) @ b[slot].float().t()
            out[t] = (y[t].float() + delta).to(y.dtype)
    return out


SHAPES = [  # (tokens, K, N, rank, slots): per-row sizes (decode) and segment sizes (prefill), odd dims
    (1, 64, 96, 8, 2),
    (7, 100, 40, 16, 3),
    (PER_ROW_MAX_TOKENS, 64, 130, 4, 4),
    (PER_ROW_MAX_TOKENS + 37, 72, 96, 16, 3),
    (150, 64, 200, 32, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_equals_per_token_loop(shape: tuple[int, ...]) -> None:
    x, a, b, token_lora, y = _case(*shape, seed=1, dtype=torch.float32)
    got = y.clone()
    lora_expand_reference(got, lora_shrink_reference(x, a, token_lora), b, token_lora)
    torch.testing.assert_close(got, _loop(x, a, b, token_lora, y), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_equals_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, a, b, token_lora, y = _case(*shape, seed=2, dtype=dtype)
    xa_ref = lora_shrink_reference(x, a, token_lora)
    xa = lora_shrink_triton(x, a, token_lora)
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, xa_ref, b, token_lora)
    lora_expand_triton(got, xa_ref, b, token_lora)  # launched before any check: compile_check.py compiles both
    has = token_lora >= 0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(xa[has], xa_ref[has], atol=tol, rtol=tol)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"


def test_expand_into_a_column_slice() -> None:
    """Merged q/k/v: each part expands into its own columns of the wider output; the others stay untouched."""
    x, a, b, token_lora, _ = _case(20, 64, 48, 8, 2, seed=3, dtype=torch.float32)
    wide = torch.randn(20, 160)
    want, got = wide.clone(), wide.clone()
    xa = lora_shrink_reference(x, a, token_lora)
    lora_expand_reference(want[:, 50:98], xa, b, token_lora)
    lora_expand_triton(got[:, 50:98], xa, b, token_lora)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[:, :50], wide[:, :50]) and torch.equal(got[:, 98:], wide[:, 98:])


PART_SIZES = [(40, 24, 24), (130, 24, 70)]  # not multiples of either kernel's column tile; parts over 2 tiles


@pytest.mark.parametrize("num_tokens", [9, PER_ROW_MAX_TOKENS + 21], ids=["row", "segment"])
@pytest.mark.parametrize("sizes", PART_SIZES, ids=lambda s: "-".join(map(str, s)))
def test_fused_expand_equals_per_part_expands(sizes: tuple[int, ...], num_tokens: int) -> None:
    """Merged q/k/v in one launch: part p's columns take B's rows of part p and xa's columns p*R .. p*R+R-1,
    as one expand per part into its column slice would; rows without an adapter stay untouched."""
    rank, slots = 8, 3
    x, a, b, _, y = _case(num_tokens, 48, sum(sizes), rank * len(sizes), slots, seed=4, dtype=torch.float32)
    pattern = torch.tensor([1, -1, 0, 2, 2, 0, -1, 1, 1], dtype=torch.int32)  # every slot and no adapter
    token_lora = pattern.repeat_interleave(-(-num_tokens // len(pattern)))[:num_tokens].contiguous()
    xa = lora_shrink_reference(x, a, token_lora)  # [T, parts * rank]
    b = b[:, :, :rank].contiguous()  # [slots, sum out, rank]: the parts' B stacked along the output
    offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    layout = LoraPartLayout(offsets, torch.device("cpu"))
    per_part, want, got = y.clone(), y.clone(), y.clone()
    for part, (start, end) in enumerate(zip(offsets, offsets[1:])):
        xa_part = xa[:, part * rank : (part + 1) * rank]
        lora_expand_triton(per_part[:, start:end], xa_part, b[:, start:end].contiguous(), token_lora)
    lora_expand_reference(want, xa, b, token_lora, layout)
    lora_expand_triton(got, xa, b, token_lora, layout)
    torch.testing.assert_close(got, per_part, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    loop = y.clone()
    for part, (start, end) in enumerate(zip(offsets, offsets[1:])):
        a_part = a[:, part * rank : (part + 1) * rank]
        loop[:, start:end] = _loop(x, a_part, b[:, start:end], token_lora, y[:, start:end])
    torch.testing.assert_close(want, loop, atol=1e-4, rtol=1e-4)
    has = token_lora >= 0
    assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"


def test_part_layout_refuses_mismatched_shapes() -> None:
    layout = LoraPartLayout([0, 40, 64], torch.device("cpu"))
    y, xa, b = torch.zeros(3, 64), torch.zeros(3, 8), torch.zeros(2, 64, 8)
    with pytest.raises(ValueError, match="2 x rank 8"):
        lora_expand_reference(y, xa, b, torch.zeros(3, dtype=torch.int32), layout)
    with pytest.raises(ValueError, match="strictly increase"):
        LoraPartLayout([0, 40, 40], torch.device("cpu"))
