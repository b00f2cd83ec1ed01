"""Mamba kernels: Triton (interpreter on the CPU) against the PyTorch references, and the references against
a whole-sequence computation, on awkward shapes (channels and state sizes not powers of two, empty rows
never, one-token rows, rows in a slot order unlike the batch order)."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.causal_conv1d import causal_conv1d_varlen_reference, causal_conv1d_varlen_triton
from framework.layers.kernels.selective_scan import (
    ScanInputs,
    ScanWeights,
    selective_scan_varlen_reference,
    selective_scan_varlen_triton,
    selective_state_update_reference,
    selective_state_update_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)


def _scan_case(seed: int, dim: int, nstate: int, lens: list[int]) -> tuple[ScanInputs, ScanWeights]:
    g = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(DEVICE)

    inp = ScanInputs(x=r(t, dim), dt=r(t, dim, scale=2.0), B=r(t, nstate), C=r(t, nstate), z=r(t, dim))
    w = ScanWeights(A=-torch.rand(dim, nstate, generator=g).to(DEVICE) * 2, D=r(dim), dt_bias=r(dim, scale=0.5))
    return inp, w


# (dim, nstate, rows' token counts, slots of the rows)
SCAN_SHAPES = [
    (24, 16, [5, 1, 3], [2, 0, 5]),
    (7, 5, [1, 1], [1, 0]),
    (40, 12, [9, 2, 1, 4], [3, 6, 0, 1]),
]


@pytest.mark.parametrize("dim,nstate,lens,slots", SCAN_SHAPES)
def test_selective_scan_triton_matches_reference(dim: int, nstate: int, lens: list[int], slots: list[int]) -> None:
    inp, w = _scan_case(1, dim, nstate, lens)
    state0 = torch.randn(8, dim, nstate, device=DEVICE)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    ref_state, tri_state = state0.clone(), state0.clone()
    num_tail = 3
    ref_tail = torch.zeros(len(lens), num_tail, dim, nstate, device=DEVICE)
    tri_tail = ref_tail.clone()
    ref = selective_scan_varlen_reference(inp, w, ref_state, idx, _qsl(lens), ref_tail)
    tri = selective_scan_varlen_triton(inp, w, tri_state, idx, _qsl(lens), tri_tail)
    torch.testing.assert_close(tri, ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tri_state, ref_state, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tri_tail, ref_tail, atol=1e-4, rtol=1e-4)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(tri_state[untouched], state0[untouched])


def test_scan_in_chunks_equals_scan_in_one_go() -> None:
    """A row split into chunks (chunked prefill, then decode steps) ends where one pass ends."""
    dim, nstate, n = 12, 6, 11
    inp, w = _scan_case(2, dim, nstate, [n])
    idx = torch.tensor([3], dtype=torch.int32, device=DEVICE)
    whole = torch.zeros(4, dim, nstate, device=DEVICE)
    y_whole = selective_scan_varlen_reference(inp, w, whole, idx, _qsl([n]))
    for fn in (selective_scan_varlen_reference, selective_scan_varlen_triton):
        state = torch.zeros(4, dim, nstate, device=DEVICE)
        pieces = []
        for lo, hi in ((0, 4), (4, 5), (5, 10), (10, 11)):
            part = ScanInputs(*(t[lo:hi] for t in inp))
            pieces.append(fn(part, w, state, idx, _qsl([hi - lo])))
        torch.testing.assert_close(torch.cat(pieces), y_whole, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dim,nstate", [(24, 16), (9, 3)])
def test_state_update_matches_one_token_scan(dim: int, nstate: int) -> None:
    inp, w = _scan_case(3, dim, nstate, [1, 1, 1])
    idx = torch.tensor([4, 1, 2], dtype=torch.int32, device=DEVICE)
    state0 = torch.randn(5, dim, nstate, device=DEVICE)
    scan_state = state0.clone()
    scan = selective_scan_varlen_reference(inp, w, scan_state, idx, _qsl([1, 1, 1]))
    for fn in (selective_state_update_reference, selective_state_update_triton):
        state = state0.clone()
        out = fn(inp, w, state, idx)
        torch.testing.assert_close(out, scan, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, scan_state, atol=1e-5, rtol=1e-5)


CONV_SHAPES = [
    (20, 4, [5, 1, 2], [1, 3, 0]),  # rows shorter than the kernel continue from the state
    (33, 3, [1, 1, 1, 1], [0, 1, 2, 3]),
    (8, 4, [12], [2]),
]


@pytest.mark.parametrize("dim,k,lens,slots", CONV_SHAPES)
def test_causal_conv1d_triton_matches_reference(dim: int, k: int, lens: list[int], slots: list[int]) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(sum(lens), dim, generator=g).to(DEVICE)
    weight, bias = torch.randn(dim, k, generator=g).to(DEVICE), torch.randn(dim, generator=g).to(DEVICE)
    state0 = torch.randn(4, dim, k - 1, generator=g).to(DEVICE)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    ref_state, tri_state = state0.clone(), state0.clone()
    ref_tail = torch.zeros(len(lens), 2, dim, k - 1, device=DEVICE)
    tri_tail = ref_tail.clone()
    ref = causal_conv1d_varlen_reference(x, weight, bias, ref_state, idx, _qsl(lens), ref_tail)
    tri = causal_conv1d_varlen_triton(x, weight, bias, tri_state, idx, _qsl(lens), tri_tail)
    torch.testing.assert_close(tri, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri_state, ref_state)
    torch.testing.assert_close(tri_tail, ref_tail)
    no_bias = causal_conv1d_varlen_triton(x, weight, None, state0.clone(), idx, _qsl(lens))
    torch.testing.assert_close(
        no_bias, causal_conv1d_varlen_reference(x, weight, None, state0.clone(), idx, _qsl(lens)), atol=1e-5, rtol=1e-5
    )


def test_causal_conv1d_reference_equals_padded_conv() -> None:
    """From a zero state, the varlen conv is torch's causal depthwise conv (left zero padding) + silu, and
    split into chunks it gives the same outputs and final state."""
    dim, k, n = 6, 4, 9
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, dim, generator=g)
    weight, bias = torch.randn(dim, k, generator=g), torch.randn(dim, generator=g)
    conv = torch.nn.functional.conv1d(x.t()[None], weight[:, None], bias, padding=k - 1, groups=dim)[0, :, :n]
    expected = torch.nn.functional.silu(conv).t()
    idx = torch.tensor([1], dtype=torch.int32)
    state = torch.zeros(2, dim, k - 1)
    got = causal_conv1d_varlen_reference(x, weight, bias, state, idx, torch.tensor([0, n], dtype=torch.int32))
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[1], x[-(k - 1) :].t())
    chunked = torch.zeros(2, dim, k - 1)
    parts = [
        causal_conv1d_varlen_reference(
            x[lo:hi], weight, bias, chunked, idx, torch.tensor([0, hi - lo], dtype=torch.int32)
        )
        for lo, hi in ((0, 2), (2, 3), (3, 9))
    ]
    torch.testing.assert_close(torch.cat(parts), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, state)


# ---- snapshots (prefix caching of hybrids) -----------------------------------------------------------------
# rows' token counts, slots, and per row the (tokens consumed, pool slot) snapshots: before the step (0), inside,
# at the row's end, several per row, none for a row, a one-token row
SNAP_CASE = ([6, 1, 9, 3], [2, 0, 5, 1], [[(0, 4), (2, 0), (6, 6)], [(1, 3)], [], [(1, 1), (2, 2), (3, 5)]])


def _targets(per_row: list[list[tuple[int, int]]]):  # type: ignore[no-untyped-def]
    from framework.layers.kernels.state_snapshots import build_snapshot_targets

    flat = [(row, n, slot) for row, entries in enumerate(per_row) for n, slot in entries]
    return build_snapshot_targets(
        [f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat], len(per_row), torch.device(DEVICE)
    )


def test_scan_snapshots_triton_matches_reference_and_prefix_runs() -> None:
    """Each snapshot equals the state after running only that many of the row's tokens from the slot state."""
    lens, slots, per_row = SNAP_CASE
    dim, nstate = 10, 6
    inp, w = _scan_case(6, dim, nstate, lens)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    state0 = torch.randn(6, dim, nstate, device=DEVICE)
    targets = _targets(per_row)
    pools = {}
    for name, fn in (("ref", selective_scan_varlen_reference), ("tri", selective_scan_varlen_triton)):
        pools[name] = torch.full((8, dim, nstate), 7.0, device=DEVICE)
        state = state0.clone()
        out = fn(inp, w, state, idx, _qsl(lens), None, targets, pools[name])
        plain_state = state0.clone()
        torch.testing.assert_close(out, fn(inp, w, plain_state, idx, _qsl(lens)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, plain_state)  # snapshots change nothing else
    torch.testing.assert_close(pools["tri"], pools["ref"], atol=1e-4, rtol=1e-4)
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    for row, entries in enumerate(per_row):
        for n, pool_slot in entries:
            state = state0.clone()
            part = ScanInputs(*(t[starts[row] : starts[row] + n] for t in inp))
            selective_scan_varlen_reference(part, w, state, idx[row : row + 1], _qsl([n]))
            torch.testing.assert_close(pools["ref"][pool_slot], state[slots[row]], atol=1e-5, rtol=1e-5)
    assert torch.all(pools["tri"][7] == 7.0)  # a pool slot nobody asked for is untouched


def test_conv_snapshots_triton_matches_reference_and_prefix_runs() -> None:
    lens, slots, per_row = SNAP_CASE
    dim, k = 12, 4
    g = torch.Generator().manual_seed(8)
    x = torch.randn(sum(lens), dim, generator=g).to(DEVICE)
    weight, bias = torch.randn(dim, k, generator=g).to(DEVICE), torch.randn(dim, generator=g).to(DEVICE)
    state0 = torch.randn(6, dim, k - 1, generator=g).to(DEVICE)
    idx = torch.tensor(slots, dtype=torch.int32, device=DEVICE)
    targets = _targets(per_row)
    pools = {}
    for name, fn in (("ref", causal_conv1d_varlen_reference), ("tri", causal_conv1d_varlen_triton)):
        pools[name] = torch.full((8, dim, k - 1), 7.0, device=DEVICE)
        state = state0.clone()
        out = fn(x, weight, bias, state, idx, _qsl(lens), None, targets, pools[name])
        plain_state = state0.clone()
        torch.testing.assert_close(out, fn(x, weight, bias, plain_state, idx, _qsl(lens)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(state, plain_state)
    torch.testing.assert_close(pools["tri"], pools["ref"])
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    for row, entries in enumerate(per_row):
        for n, pool_slot in entries:
            state = state0.clone()
            if n:  # (no tokens: the slot's state as it was)
                causal_conv1d_varlen_reference(
                    x[starts[row] : starts[row] + n], weight, bias, state, idx[row : row + 1], _qsl([n])
                )
            torch.testing.assert_close(pools["ref"][pool_slot], state[slots[row]])
    assert torch.all(pools["tri"][7] == 7.0)
