"""LoRA shrink / expand: the Triton kernels (interpreter on the CPU) against their PyTorch references, and the
references against a plain per-token loop (each token's x @ A_l^T @ B_l^T, nothing shared between tokens)."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels import lora
from framework.layers.kernels.lora import (
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
    (64, 64, 130, 4, 4),
    (101, 72, 96, 16, 3),
    (150, 64, 200, 32, 2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_equals_per_token_loop(shape: tuple[int, ...]) -> None:
    x, a, b, token_lora, y = _case(*shape, seed=1, dtype=torch.float32)
    got = y.clone()
    lora_expand_reference(got, lora_shrink_reference(x, a, token_lora), b, token_lora)
    torch.testing.assert_close(got, _loop(x, a, b, token_lora, y), atol=1e-4, rtol=1e-4)


def _summed(xa: torch.Tensor) -> torch.Tensor:
    """[T, R]: a split shrink's partials [S, T, R] summed (what the expand adds), or a plain shrink's output."""
    return xa.sum(0) if xa.dim() == 3 else xa


@pytest.mark.parametrize("variant", lora.SHRINK_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_shrink_equals_reference(shape: tuple[int, ...], dtype: torch.dtype, variant: str) -> None:
    x, a, _, token_lora, _ = _case(*shape, seed=2, dtype=dtype)
    xa = _summed(lora_shrink_triton(x, a, token_lora, variant=variant, splits=3))
    has = token_lora >= 0
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(xa[has], lora_shrink_reference(x, a, token_lora)[has], atol=tol, rtol=tol)


@pytest.mark.parametrize("variant", lora.EXPAND_VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_triton_expand_equals_reference(shape: tuple[int, ...], dtype: torch.dtype, variant: str) -> None:
    x, a, b, token_lora, y = _case(*shape, seed=2, dtype=dtype)
    xa_ref = lora_shrink_reference(x, a, token_lora)
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, xa_ref, b, token_lora)
    lora_expand_triton(got, xa_ref, b, token_lora, variant=variant)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    has = token_lora >= 0
    assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"


@pytest.mark.parametrize("num_tokens", [1, lora.SPLIT_K_MAX_TOKENS, lora.SPLIT_K_MAX_TOKENS + 1])
def test_default_launches_equal_the_reference(num_tokens: int) -> None:
    """The dispatch's own choice at each size (split shrink + per-row expand, or segment launches above)."""
    x, a, b, token_lora, y = _case(num_tokens, 600, 40, 8, 3, seed=12, dtype=torch.float32)  # 2 K ranges
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, lora_shrink_reference(x, a, token_lora), b, token_lora)
    lora.lora_expand(got, lora.lora_shrink(x, a, token_lora, backend="triton"), b, token_lora, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


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


@pytest.mark.parametrize("variant", lora.EXPAND_VARIANTS)
@pytest.mark.parametrize("sizes", PART_SIZES, ids=lambda s: "-".join(map(str, s)))
def test_fused_expand_equals_per_part_expands(sizes: tuple[int, ...], variant: str) -> None:
    """Merged q/k/v in one launch: part p's columns take B's rows of part p and xa's columns p*R .. p*R+R-1,
    as one expand per part into its column slice would; rows without an adapter stay untouched."""
    rank, slots, num_tokens = 8, 3, 40
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
        lora_expand_triton(per_part[:, start:end], xa_part, b[:, start:end].contiguous(), token_lora, variant=variant)
    lora_expand_reference(want, xa, b, token_lora, layout)
    lora_expand_triton(got, xa, b, token_lora, layout, variant=variant)
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


# (tokens, K, N, rank, slots, splits asked, K ranges made): K 200 = ranges 64, 64, 64, 8; K 100 asks for 8
# ranges but has 2 steps of 64 columns; tokens decode-sized (above the per-row kernel) and prefill-sized
SPLIT_SHAPES = [
    (101, 200, 96, 16, 3, 4, 4),
    (40, 136, 72, 8, 2, 3, 3),
    (20, 100, 40, 4, 3, 8, 2),
]


def _round_robin(num_tokens: int, slots: int) -> torch.Tensor:
    """Decode-like: one token per request, requests' adapters round robin, every third token without one."""
    ids = torch.arange(num_tokens, dtype=torch.int32) % (slots + 1) - 1
    return torch.where(torch.arange(num_tokens) % 3 == 1, torch.full_like(ids, -1), ids)


@pytest.mark.parametrize("spread", ["segments", "round_robin"])
@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_shrink_partials_sum_to_reference(shape: tuple[int, ...], spread: str) -> None:
    """Split K: S float32 partials whose sum is the shrink; both expands add them up as they load xa."""
    num_tokens, k, n, rank, slots, splits, ranges = shape
    x, a, b, token_lora, y = _case(num_tokens, k, n, rank, slots, seed=5, dtype=torch.float32)
    if spread == "round_robin":
        token_lora = _round_robin(num_tokens, slots)
    xa_ref = lora_shrink_reference(x, a, token_lora)
    partials = lora_shrink_triton(x, a, token_lora, variant="split", splits=splits)
    assert partials.shape == (ranges, num_tokens, rank)
    has = token_lora >= 0
    torch.testing.assert_close(partials.sum(0)[has], xa_ref[has], atol=1e-4, rtol=1e-4)
    want = y.clone()
    lora_expand_reference(want, xa_ref, b, token_lora)
    for variant in ("row", "segment"):
        got = y.clone()
        lora_expand_triton(got, partials, b, token_lora, variant=variant)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"
    ref_got = y.clone()
    lora_expand_reference(ref_got, partials, b, token_lora)  # the CPU path takes partials too
    torch.testing.assert_close(ref_got, want, atol=1e-4, rtol=1e-4)


def test_dropped_partial_is_caught() -> None:
    """Planted fault: an expand that sees one K range fewer differs from the reference (the check above can fail)."""
    x, a, b, token_lora, y = _case(50, 200, 64, 8, 2, seed=6, dtype=torch.float32)
    partials = lora_shrink_triton(x, a, token_lora, variant="split", splits=4)
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, lora_shrink_reference(x, a, token_lora), b, token_lora)
    lora_expand_triton(got, partials[:-1].contiguous(), b, token_lora, variant="segment")
    assert not torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", ["row", "segment"])
def test_split_partials_through_a_fused_expand(variant: str) -> None:
    """Merged q/k/v: part p reads columns p*R .. p*R+R-1 of every partial."""
    sizes, rank, slots, num_tokens = (40, 24, 70), 8, 3, 45
    x, a, b, _, y = _case(num_tokens, 136, sum(sizes), rank * len(sizes), slots, seed=7, dtype=torch.float32)
    token_lora = _round_robin(num_tokens, slots)
    b = b[:, :, :rank].contiguous()
    layout = LoraPartLayout([0, 40, 64, 134], torch.device("cpu"))
    partials = lora_shrink_triton(x, a, token_lora, variant="split", splits=3)  # [3, T, 3 * rank]
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, lora_shrink_reference(x, a, token_lora), b, token_lora, layout)
    lora_expand_triton(got, partials, b, token_lora, layout, variant=variant)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_segment_shrink_with_16_row_tiles() -> None:
    x, a, _, token_lora, _ = _case(101, 72, 8, 16, 3, seed=8, dtype=torch.bfloat16)
    xa = lora_shrink_triton(x, a, token_lora, variant="segment", block_m=16)
    has = token_lora >= 0
    torch.testing.assert_close(xa[has], lora_shrink_reference(x, a, token_lora)[has], atol=2e-2, rtol=2e-2)


def test_shrink_plan_default_and_split_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """Default: split K up to SPLIT_K_MAX_TOKENS (K / 256 ranges, at most MAX_SPLITS), segment above; the
    dispatch's partials still give the reference's update."""
    assert lora.shrink_plan(1, 1024) == ("split", 4)
    assert lora.shrink_plan(lora.SPLIT_K_MAX_TOKENS, 512) == ("split", 2)
    assert lora.shrink_plan(lora.SPLIT_K_MAX_TOKENS, 12288) == ("split", lora.MAX_SPLITS)
    assert lora.shrink_plan(lora.SPLIT_K_MAX_TOKENS + 1, 1024) == ("segment", 1)
    monkeypatch.setattr(lora, "SPLIT_K_MAX_TOKENS", 0)
    assert lora.shrink_plan(1, 1024) == ("segment", 1)
    monkeypatch.setattr(lora, "SPLIT_K_MAX_TOKENS", 256)
    monkeypatch.setattr(lora, "MIN_SPLIT_K", 64)
    x, a, b, token_lora, y = _case(69, 192, 48, 8, 2, seed=9, dtype=torch.float32)
    xa = lora.lora_shrink(x, a, token_lora, backend="triton")
    assert xa.dim() == 3 and xa.shape[0] == 3
    want, got = y.clone(), y.clone()
    lora_expand_reference(want, lora_shrink_reference(x, a, token_lora), b, token_lora)
    lora.lora_expand(got, xa, b, token_lora, backend="triton")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_unknown_variant_is_refused() -> None:
    x, a, b, token_lora, y = _case(4, 64, 32, 4, 2, seed=10, dtype=torch.float32)
    with pytest.raises(ValueError, match="shrink variant 'tiles'"):
        lora_shrink_triton(x, a, token_lora, variant="tiles")
    with pytest.raises(ValueError, match="expand variant 'split'"):
        lora_expand_triton(y, lora_shrink_reference(x, a, token_lora), b, token_lora, variant="split")
