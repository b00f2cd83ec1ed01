"""LoRA over rows grouped by adapter: the sorted layout, the fused shrink + expand and the unfused sorted pair
(interpreter on the CPU) against the reference composition (`lora_shrink_reference` then `lora_expand_reference`),
the per-step buffer `LoraTokens` lays out, and `LoraGroup.add`'s opt-in dispatch; planted faults in the layout and
the grid must fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_lora_kernels import PART_SIZES, _case, _loop, _round_robin

from framework.layers.kernels import lora_fused
from framework.layers.kernels.launch_math import cdiv
from framework.layers.kernels.lora import LoraPartLayout
from framework.layers.kernels.lora_fused import (
    lora_expand_sorted_triton,
    lora_segments,
    lora_segments_of,
    lora_shrink_expand_reference,
    lora_shrink_expand_triton,
    lora_shrink_sorted_triton,
)
from framework.models.lora.adapter import ProjectionShape
from framework.models.lora.projection import LoraGroup, LoraTokens

CPU = torch.device("cpu")


def test_segments_group_tokens_by_slot_in_token_order() -> None:
    rows, bounds = lora_segments(np.array([2, -1, 0, 2, 0, -1, 2], dtype=np.int32), num_slots=4)
    assert rows.tolist() == [2, 4, 0, 3, 6] and bounds.tolist() == [0, 2, 2, 5, 5]
    rows, bounds = lora_segments(np.full(3, -1, dtype=np.int32), num_slots=2)
    assert rows.tolist() == [] and bounds.tolist() == [0, 0, 0]


def _spread(kind: str, num_tokens: int, slots: int, token_lora: torch.Tensor) -> torch.Tensor:
    if kind == "round_robin":  # decode: adapters interleaved row by row, every third row without one
        return _round_robin(num_tokens, slots)
    if kind == "one":  # every row one adapter (its segment spans every row tile)
        return torch.full((num_tokens,), slots - 1, dtype=torch.int32)
    return token_lora  # segments of one adapter each, some without one (prefill-like)


def _fused(y, x, a, b, token_lora, parts=None, variant="fused", block_n=32):  # type: ignore[no-untyped-def]
    rows, bounds = lora_segments_of(token_lora, b.shape[0])
    if variant.startswith("fused"):  # "fused": one column tile a program; "fusedxT": T tiles a program
        tiles = int(variant.partition("x")[2] or 1)
        lora_shrink_expand_triton(y, x, a, b, rows, bounds, parts, block_n=block_n, tiles_per_program=tiles)
    else:
        xa = lora_shrink_sorted_triton(x, a, rows, bounds, b.shape[2])
        lora_expand_sorted_triton(y, xa, b, rows, bounds, parts, block_n=block_n)


SHAPES = [(1, 64, 96, 8, 2), (7, 100, 40, 16, 3), (101, 72, 96, 16, 3), (37, 64, 130, 4, 4)]  # T, K, N, R, L


@pytest.mark.parametrize("variant", ["fused", "fusedx3", "sorted"])
@pytest.mark.parametrize("spread", ["segments", "round_robin", "one"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grouped_launches_equal_the_reference(shape: tuple[int, ...], spread: str, variant: str) -> None:
    x, a, b, token_lora, y = _case(*shape, seed=21, dtype=torch.float32)
    token_lora = _spread(spread, shape[0], shape[4], token_lora)
    want, got = y.clone(), y.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora)
    _fused(got, x, a, b, token_lora, variant=variant)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(want, _loop(x, a, b, token_lora, y), atol=1e-4, rtol=1e-4)
    has = token_lora >= 0
    assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"


@pytest.mark.parametrize("variant", ["fused", "sorted"])
def test_bfloat16_equals_the_reference(variant: str) -> None:
    x, a, b, token_lora, y = _case(45, 72, 80, 16, 3, seed=22, dtype=torch.bfloat16)
    want, got = y.clone(), y.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora)
    _fused(got, x, a, b, token_lora, variant=variant)
    torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("variant", ["fused", "fusedx2", "fusedx3", "sorted"])
@pytest.mark.parametrize("sizes", PART_SIZES, ids=lambda s: "-".join(map(str, s)))
def test_merged_parts_read_their_own_rank_block(sizes: tuple[int, ...], variant: str) -> None:
    """Merged q/k/v: part p's columns take A's rows and xa's columns p*R .. p*R+R-1 and B's rows of part p; parts
    are not multiples of the 32-column tile, so a tile that straddled two parts would mix them. `fusedxT`: a
    program's T column tiles span parts (every part's xa computed once), the last program holds fewer."""
    rank, slots, num_tokens = 8, 3, 40
    x, a, b, _, y = _case(num_tokens, 48, sum(sizes), rank * len(sizes), slots, seed=23, dtype=torch.float32)
    token_lora = _round_robin(num_tokens, slots)
    b = b[:, :, :rank].contiguous()
    layout = LoraPartLayout([sum(sizes[:i]) for i in range(len(sizes) + 1)], CPU)
    want, got = y.clone(), y.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora, layout)
    _fused(got, x, a, b, token_lora, layout, variant=variant)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    has = token_lora >= 0
    assert torch.equal(got[~has], y[~has]), "a row without an adapter was written"


def _fault_case() -> tuple[torch.Tensor, ...]:
    x, a, b, token_lora, y = _case(40, 64, 48, 8, 3, seed=24, dtype=torch.float32)
    return x, a, b, _round_robin(40, 3), y


@pytest.mark.parametrize("fault", ["start_off_by_one", "last_tile_dropped", "no_fault"])
def test_planted_layout_faults_are_caught(fault: str) -> None:
    """The comparison can fail: a segment start off by one (a row of another slot) or a segment cut to whole
    tiles (its last partial tile never run) differs from the reference."""
    x, a, b, token_lora, y = _fault_case()
    rows, bounds = lora_segments_of(token_lora, b.shape[0])
    if fault == "start_off_by_one":
        bounds[1] += 1
    elif fault == "last_tile_dropped":
        bounds[1] = bounds[0] + (bounds[1] - bounds[0]) // lora_fused.FUSED_BLOCK_M * lora_fused.FUSED_BLOCK_M
    want, got = y.clone(), y.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora)
    lora_shrink_expand_triton(got, x, a, b, rows, bounds, block_n=32)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4) == (fault == "no_fault")


def test_a_grid_one_row_tile_short_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted fault in the launch: one row tile fewer per slot leaves one adapter's last rows without update."""
    x, a, b, _, y = _case(40, 64, 48, 8, 3, seed=25, dtype=torch.float32)
    token_lora = torch.full((40,), 1, dtype=torch.int32)
    want, got = y.clone(), y.clone()
    lora_shrink_expand_reference(want, x, a, b, token_lora)
    monkeypatch.setattr(lora_fused, "cdiv", lambda n, d: cdiv(n, d) - 1)
    _fused(got, x, a, b, token_lora)
    assert not torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_rows_past_the_token_count_are_masked() -> None:
    """A forward smaller than the step that wrote the layout (a warm-up run) updates only its own rows."""
    x, a, b, token_lora, y = _case(30, 64, 48, 8, 3, seed=26, dtype=torch.float32)
    token_lora = _round_robin(30, 3)
    rows, bounds = lora_segments_of(token_lora, 3)  # the layout of 30 tokens
    want, got = y[:10].clone(), y[:10].clone()
    lora_shrink_expand_reference(want, x[:10], a, b, token_lora[:10])
    lora_shrink_expand_triton(got, x[:10].contiguous(), a, b, rows, bounds, block_n=32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_shapes_are_checked() -> None:
    x, a, b, token_lora, y = _case(4, 64, 48, 8, 2, seed=27, dtype=torch.float32)
    rows, bounds = lora_segments_of(token_lora, 2)
    with pytest.raises(ValueError, match="slot_bounds has 2 entries"):
        lora_shrink_expand_triton(y, x, a, b, rows, bounds[:2])
    with pytest.raises(ValueError, match="2 part"):
        lora_shrink_expand_triton(y, x, a, b, rows, bounds, LoraPartLayout([0, 20, 48], CPU))
    with pytest.raises(ValueError, match="not whole parts of rank 3"):
        lora_shrink_sorted_triton(x, a, rows, bounds, 3)


def _view_segments(tokens: LoraTokens) -> tuple[list[int], list[int]]:
    bounds = tokens.slot_bounds.tolist()
    return tokens.sorted_rows[bounds[0] : bounds[-1]].tolist(), [b - bounds[0] for b in bounds]


def test_token_buffer_stages_a_step_in_one_contiguous_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """`stage` lays a step out so one copy of its range writes the map and the sorted layout; a later step with
    fewer tokens and no adapter clears what the earlier one wrote; a step above `FUSED_MAX_TOKENS` (whose forwards
    never read the layout) sends it empty rather than leave an earlier step's segments."""
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 8)
    tokens = LoraTokens(max_tokens=13, max_loras=3, device=CPU)
    assert tokens.slot_bounds.tolist() == [tokens.rows_end] * 4  # nothing staged yet: every segment empty
    host = np.zeros(tokens.buffer.shape[0], dtype=np.int32)
    mixed = np.array([2, 2, -1, 0, 1, 1, 0, 2], dtype=np.int32)
    big = np.array([1, 0] * 6, dtype=np.int32)
    steps = [(mixed, 8, True), (np.full(5, -1, dtype=np.int32), 8, True), (mixed, 8, True), (big, 12, False)]
    for per_token, count, grouped in steps:
        host[:] = 99  # whatever the host buffer held: only the returned range is copied
        start, stop = tokens.stage(host, per_token, count)
        tokens.buffer[start:stop] = torch.from_numpy(host[start:stop])
        want_rows, want_bounds = lora_segments(per_token if grouped else per_token[:0], 3)
        assert _view_segments(tokens) == (want_rows.tolist(), want_bounds.tolist())
        assert tokens.token_lora[:count].tolist() == [*per_token.tolist(), *[-1] * (count - len(per_token))]


@pytest.mark.parametrize("parts", [("q_proj", "k_proj", "v_proj"), ("o_proj",)])
def test_group_takes_the_fused_launch_when_opted_in(parts: tuple[str, ...], monkeypatch: pytest.MonkeyPatch) -> None:
    """`LoraGroup.add` with `FUSED_MAX_TOKENS` raised: the fused launch over the staged layout, equal to the
    default shrink + expand pair; a token count above it keeps the pair."""
    num_tokens, rank, slots = 20, 8, 3
    shapes = [ProjectionShape(48, n) for n in (40, 24, 24)[: len(parts)]]
    tokens = LoraTokens(num_tokens, slots, CPU)
    group = LoraGroup(0, parts, shapes, slots, rank, tokens, torch.float32, CPU)
    group.kernel_backend = "triton"
    gen = torch.Generator().manual_seed(28)
    group.lora_a.copy_(torch.randn(group.lora_a.shape, generator=gen) * 0.2)
    group.lora_b.copy_(torch.randn(group.lora_b.shape, generator=gen) * 0.2)
    x = torch.randn(num_tokens, 48, generator=gen)
    out = torch.randn(num_tokens, group.offsets[-1], generator=gen)
    calls: list[int] = []
    real = lora_fused.lora_shrink_expand_triton

    def counted(*args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        calls.append(1)
        real(*args, **kwargs)

    monkeypatch.setattr(lora_fused, "lora_shrink_expand_triton", counted)
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", num_tokens)
    host = np.zeros(tokens.buffer.shape[0], dtype=np.int32)
    start, stop = tokens.stage(host, _round_robin(num_tokens, slots).numpy(), num_tokens)
    tokens.buffer[start:stop] = torch.from_numpy(host[start:stop])
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", 0)
    want = group.add(x, out.clone())  # default: the shrink + expand pair
    assert calls == []
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", num_tokens)
    torch.testing.assert_close(group.add(x, out.clone()), want, atol=1e-4, rtol=1e-4)
    assert calls == [1]
    monkeypatch.setattr(lora_fused, "FUSED_MAX_TOKENS", num_tokens - 1)
    group.add(x, out.clone())
    assert calls == [1], "above FUSED_MAX_TOKENS the pair runs"
