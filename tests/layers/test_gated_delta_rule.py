"""Gated DeltaNet kernels: the token-by-token reference against HF transformers' own PyTorch fallbacks, the
chunked form and the Triton kernel (interpreter on the CPU) against the reference, with tails, snapshots,
grouped key heads, awkward head sizes and rows in a slot order unlike the batch order; the gated RMSNorm."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.gated_delta_rule import (
    DeltaRuleInputs,
    chunk_gated_delta_rule,
    gated_delta_rule_decode_reference,
    gated_delta_rule_varlen_chunked,
    gated_delta_rule_varlen_reference,
    gated_delta_rule_varlen_triton,
)
from framework.layers.kernels.gated_rms_norm import gated_rms_norm_reference, gated_rms_norm_triton
from framework.layers.kernels.state_snapshots import build_snapshot_targets


def _qsl(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _case(seed: int, lens: list[int], hk: int, h: int, dk: int, dv: int) -> DeltaRuleInputs:
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return DeltaRuleInputs(
        q=r(t, hk, dk),
        k=r(t, hk, dk),
        v=r(t, h, dv),
        g=-torch.rand(t, h, generator=gen) * 0.7,
        beta=torch.rand(t, h, generator=gen),
    )


def test_reference_matches_hf_fallbacks() -> None:
    """One sequence from a nonzero state: our reference and chunked form equal HF's recurrent and chunked ones."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    inp = _case(0, [37], 2, 4, 8, 6)
    h0 = torch.randn(1, 4, 8, 6)
    args = (inp.q[None], inp.k[None], inp.v[None])
    hf_rec, hf_state = hf.torch_recurrent_gated_delta_rule(
        *args,
        g=inp.g[None],
        beta=inp.beta[None],
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    hf_chunk, _ = hf.torch_chunk_gated_delta_rule(
        *args,
        g=inp.g[None],
        beta=inp.beta[None],
        chunk_size=8,
        initial_state=h0,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(hf_chunk, hf_rec, atol=1e-4, rtol=1e-4)
    state = torch.zeros(3, 4, 8, 6)
    state[2] = h0[0]
    ours = gated_delta_rule_varlen_reference(inp, state, torch.tensor([2], dtype=torch.int32), _qsl([37]))
    torch.testing.assert_close(ours, hf_rec[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state[2], hf_state[0], atol=1e-5, rtol=1e-5)


# (rows' token counts, slots of the rows, key heads, value heads, Dk, Dv, chunk size)
SHAPES = [
    ([5, 1, 3], [2, 0, 5], 2, 2, 8, 8, 4),
    ([1, 1], [1, 0], 1, 3, 5, 7, 64),
    ([19, 2, 1, 9], [3, 6, 0, 1], 2, 4, 16, 12, 4),
]


@pytest.mark.parametrize("lens,slots,hk,h,dk,dv,chunk", SHAPES)
def test_chunked_and_triton_match_reference(lens, slots, hk, h, dk, dv, chunk) -> None:  # type: ignore[no-untyped-def]
    inp = _case(1, lens, hk, h, dk, dv)
    state0 = torch.randn(8, h, dk, dv)
    idx, qsl = torch.tensor(slots, dtype=torch.int32), _qsl(lens)
    # Snapshots: the state before the step of row 0, and inside the longest row at two points.
    longest = max(range(len(lens)), key=lambda r: lens[r])
    points = sorted({(0, 0), (longest, lens[longest] // 2), (longest, lens[longest])})
    snaps = build_snapshot_targets(
        [r for r, _ in points], [n for _, n in points], list(range(len(points))), len(lens), torch.device("cpu")
    )
    num_tail = 3
    results = {}
    for name, fn in (
        ("reference", gated_delta_rule_varlen_reference),
        ("chunked", lambda *a: gated_delta_rule_varlen_chunked(*a, chunk_size=chunk)),
        ("triton", gated_delta_rule_varlen_triton),
    ):
        state, tail = state0.clone(), torch.zeros(len(lens), num_tail, h, dk, dv)
        pool = torch.zeros(len(points), h, dk, dv)
        out = fn(inp, state, idx, qsl, tail, snaps, pool)
        results[name] = (out, state, tail, pool)
    for name in ("chunked", "triton"):
        for got, want in zip(results[name], results["reference"]):
            torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    untouched = [s for s in range(8) if s not in slots]
    assert torch.equal(results["triton"][1][untouched], state0[untouched])


def test_decode_step_matches_reference() -> None:
    inp = _case(2, [1, 1, 1], 1, 2, 8, 4)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    state0 = torch.randn(5, 2, 8, 4)
    ref_state, dec_state = state0.clone(), state0.clone()
    ref = gated_delta_rule_varlen_reference(inp, ref_state, idx, _qsl([1, 1, 1]))
    torch.testing.assert_close(gated_delta_rule_decode_reference(inp, dec_state, idx), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dec_state, ref_state, atol=1e-5, rtol=1e-5)


def test_chunk_boundaries_do_not_change_results() -> None:
    """Chunk sizes that divide the sequence, do not, and exceed it give the same outputs and state."""
    inp = _case(3, [23], 1, 2, 8, 8)
    q, k = (torch.nn.functional.normalize(x, dim=-1) for x in (inp.q, inp.k))
    h0 = torch.randn(2, 8, 8)
    ref = chunk_gated_delta_rule(q * 8**-0.5, k, inp.v, inp.g, inp.beta, h0, chunk_size=1)
    for c in (4, 5, 23, 64):
        got = chunk_gated_delta_rule(q * 8**-0.5, k, inp.v, inp.g, inp.beta, h0, chunk_size=c)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows,dim", [(5, 16), (3, 12), (1, 128)])
def test_gated_rms_norm_triton_matches_reference_and_hf(rows: int, dim: int) -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    gen = torch.Generator().manual_seed(rows)
    x, gate, w = torch.randn(rows, dim, generator=gen), torch.randn(rows, dim, generator=gen), torch.randn(dim)
    hf = Qwen3NextRMSNormGated(dim, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(w)
        want = hf(x, gate)
    torch.testing.assert_close(gated_rms_norm_reference(x, gate, w, 1e-6), want)
    torch.testing.assert_close(gated_rms_norm_triton(x, gate, w, 1e-6), want, atol=1e-5, rtol=1e-5)
