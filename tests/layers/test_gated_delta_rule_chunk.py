"""The chunked Gated DeltaNet Triton kernel (interpreter on the CPU) against the token-by-token reference:
rows longer than a chunk and not a multiple of it, empty and one-token rows, grouped key heads, head sizes under
the tensor-core minimum, slots in an order unlike the batch's, tails and snapshots (chunks cut at their points),
and a row's state carried across prefill steps (chunked prefill) equal to one step over the whole row."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.gated_delta_rule import DeltaRuleInputs, gated_delta_rule_varlen_reference
from framework.layers.kernels.gated_delta_rule_chunk import chunk_gated_delta_rule_varlen_triton
from framework.layers.kernels.state_snapshots import build_snapshot_targets

CPU = torch.device("cpu")


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _case(seed: int, t: int, hk: int, h: int, dk: int, dv: int) -> DeltaRuleInputs:
    gen = torch.Generator().manual_seed(seed)
    return DeltaRuleInputs(
        q=torch.randn(t, hk, dk, generator=gen),
        k=torch.randn(t, hk, dk, generator=gen),
        v=torch.randn(t, h, dv, generator=gen),
        g=-torch.rand(t, h, generator=gen) * 0.5,
        beta=torch.rand(t, h, generator=gen),
    )


def _chunk(inp: DeltaRuleInputs, *args) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return chunk_gated_delta_rule_varlen_triton(*inp, *args)


# (rows' token counts, slots of the rows, key heads, value heads, Dk, Dv, tails, snapshots as (row, tokens))
CASES = [
    ([150, 1, 0, 64, 5], [3, 0, 6, 1, 2], 2, 4, 16, 12, 0, []),
    ([70, 0, 1, 130], [5, 1, 0, 7], 1, 2, 5, 7, 3, [(0, 0), (0, 64), (3, 16), (3, 100), (3, 129)]),
    ([1, 1, 2], [2, 4, 0], 2, 2, 32, 16, 2, [(2, 1)]),
]


@pytest.mark.parametrize("lens,slots,hk,h,dk,dv,num_tail,points", CASES)
def test_chunk_kernel_matches_reference(lens, slots, hk, h, dk, dv, num_tail, points) -> None:  # type: ignore[no-untyped-def]
    inp = _case(sum(lens), sum(lens), hk, h, dk, dv)
    state0 = torch.randn(8, h, dk, dv)
    idx, qsl, rows = torch.tensor(slots, dtype=torch.int32), _qsl(lens), len(lens)
    snaps = (
        build_snapshot_targets([r for r, _ in points], [n for _, n in points], list(range(len(points))), rows, CPU)
        if points
        else None
    )
    results = []
    for fn in (gated_delta_rule_varlen_reference, _chunk):
        state = state0.clone()
        tail = torch.zeros(rows, num_tail, h, dk, dv) if num_tail else None
        pool = torch.zeros(len(points), h, dk, dv) if points else None
        results.append((fn(inp, state, idx, qsl, tail, snaps, pool), state, tail, pool))
    for got, want in zip(results[1], results[0]):
        if want is not None:
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(results[1][1][untouched], state0[untouched])


def test_state_carries_over_chunked_prefill_steps() -> None:
    """Two rows prefilled in three steps (cuts inside and across 64-token chunks, one step with a row absent)
    equal one step over the whole rows."""
    lens, hk, h, dk, dv = [140, 75], 1, 2, 16, 16
    inp = _case(7, sum(lens), hk, h, dk, dv)
    state0 = torch.randn(4, h, dk, dv)
    whole = state0.clone()
    want = gated_delta_rule_varlen_reference(inp, whole, torch.tensor([2, 0], dtype=torch.int32), _qsl(lens))
    steps = [(0, 37), (37, 100), (100, 140)], [(0, 75), (75, 75), (75, 75)]
    state, got = state0.clone(), torch.empty_like(want)
    for (a0, b0), (a1, b1) in zip(*steps):
        rows = [(0, a0, b0, 2), (lens[0], a1, b1, 0)]
        take = torch.cat([torch.arange(base + a, base + b) for base, a, b, _ in rows])
        part = DeltaRuleInputs(*(x[take] for x in inp))
        qsl = _qsl([b - a for _, a, b, _ in rows])
        out = _chunk(part, state, torch.tensor([s for *_, s in rows], dtype=torch.int32), qsl)
        got[take] = out
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state, whole, atol=2e-4, rtol=2e-4)


def test_bad_state_is_refused() -> None:
    inp = _case(0, 3, 1, 2, 8, 8)
    with pytest.raises(ValueError, match="state must be float32"):
        _chunk(inp, torch.zeros(2, 2, 8, 4), torch.zeros(1, dtype=torch.int32), _qsl([3]))


def test_chunk_kernel_matches_hf_chunked_fallback() -> None:
    """One 100-token sequence from a nonzero state against HF transformers' chunked PyTorch delta rule (the
    semantics of flash-linear-attention's `chunk_gated_delta_rule`, L2 norm in the kernel): outputs and final
    state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    inp = _case(5, 100, 2, 4, 16, 8)
    h0 = torch.randn(1, 4, 16, 8)
    repeat = lambda x: x.repeat_interleave(2, dim=1)[None]  # noqa: E731  (HF takes key heads repeated)
    want, want_state = hf.torch_chunk_gated_delta_rule(
        repeat(inp.q),
        repeat(inp.k),
        inp.v[None],
        g=inp.g[None],
        beta=inp.beta[None],
        chunk_size=64,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    state = torch.zeros(2, 4, 16, 8)
    state[1] = h0[0]
    got = _chunk(inp, state, torch.tensor([1], dtype=torch.int32), _qsl([100]))
    torch.testing.assert_close(got, want[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state[1], want_state[0], atol=2e-4, rtol=2e-4)
