"""One hybrid recurrent state for several recurrent layer kinds at once (Mamba, Gated DeltaNet and a kind a test
registers, as a third party would), at the state level:

- every kind gets its slabs and its forward input, built by its registered `layer_state` factory;
- with drafts, every kind's state advances by the accepted tokens only (equal to a run of only those tokens);
- a request started from a snapshot ends where a full run ends, for every kind;
- an unknown kind is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import pytest
import torch
from test_mamba_hybrid import _batch

from framework.config.schema import CacheConfig
from framework.models.gdn_layer import GatedDeltaNet, GDNGeometry
from framework.models.interface import RecurrentHybrid
from framework.models.mamba_layer import MambaMixer
from framework.models.recurrent import (
    RecurrentKind,
    RecurrentStateSpec,
    RecurrentStepInputs,
    StateTensor,
    register_recurrent_kind,
)
from framework.params.scheduler_output import StateSnapshot
from model_states.hybrid_recurrent import HybridRecurrentModelState


def _token_sums(
    slots: Sequence[torch.Tensor], tails: Optional[Sequence[torch.Tensor]], pools: Optional[Sequence[torch.Tensor]]
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    return slots[0], tails[0] if tails else None, pools[0] if pools else None


# A third party's kind: the running sum of each row's inputs (one float32 vector per slot).
register_recurrent_kind(RecurrentKind("token_sum", "token_sum", _token_sums))


def _token_sum_layer(x: torch.Tensor, layer, step: RecurrentStepInputs) -> None:  # type: ignore[no-untyped-def]
    """Advance the running sums (and store tails and snapshots) as the kernels of a real kind would."""
    state, tail, pool = layer
    starts = step.query_start_loc.tolist()
    snaps = step.snapshots
    for row, slot in enumerate(step.idx_mapping.tolist()):
        h = state[slot].clone()
        lo, hi = starts[row], starts[row + 1]
        wanted = {}
        if snaps is not None:
            a, b = snaps.row_start[row].item(), snaps.row_start[row + 1].item()
            wanted = dict(zip(snaps.num_tokens[a:b].tolist(), snaps.pool_slot[a:b].tolist()))
        if 0 in wanted:
            pool[wanted[0]] = h
        for t in range(lo, hi):
            h = h + x[t, : h.shape[0]]
            if tail is not None and t - hi + tail.shape[1] >= 0:
                tail[row, t - hi + tail.shape[1]] = h
            if t - lo + 1 in wanted:
                pool[wanted[t - lo + 1]] = h
        state[slot] = h


class _ThreeKinds(torch.nn.Module, RecurrentHybrid):
    """One layer of each kind, all reading the same inputs."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.mamba = MambaMixer(16, 24, 6, 4, 4, 1e-6, conv_bias=True, proj_bias=False)
        self.geo = GDNGeometry(16, 2, 4, 8, 6, 4, 1e-6, fused_projections=False)
        self.gdn = GatedDeltaNet(self.geo)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn_like(p))

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        mamba = RecurrentStateSpec("mamba", 1, (StateTensor((24, 3), None), StateTensor((24, 6), torch.float32)))
        sums = RecurrentStateSpec("token_sum", 1, (StateTensor((5,), torch.float32),))
        return [mamba, self.geo.state_spec(1), sums]

    def run(self, state: HybridRecurrentModelState, x: torch.Tensor, batch: SimpleNamespace) -> torch.Tensor:
        inputs = state.prepare_inputs(batch)  # type: ignore[arg-type]
        assert set(inputs) == {"mamba", "gdn", "token_sum"}
        m, g, s = inputs["mamba"], inputs["gdn"], inputs["token_sum"]
        _token_sum_layer(x, s.layers[0], s)
        return torch.cat([self.mamba(x, m.layers[0], m), self.gdn(x, g.layers[0], g)], dim=-1)


def _new(state: HybridRecurrentModelState, slot: int, computed: int = 0, snapshot: Optional[int] = None) -> None:
    state.add_request(slot, SimpleNamespace(num_computed_tokens=computed, request_id=str(slot), snapshot_slot=snapshot))


@torch.no_grad()
def test_every_kind_advances_by_accepted_tokens_only() -> None:
    model = _ThreeKinds()
    prompt, step_tokens = torch.randn(5, 16), torch.randn(4, 16)
    state = HybridRecurrentModelState(model, {}, 8, torch.device("cpu"))
    assert [tuple(s.shape) for s in state.slabs] == [
        (1, 9, 24, 3),
        (1, 9, 24, 6),
        (1, 9, 56, 3),
        (1, 9, 4, 8, 6),
        (1, 9, 5),
    ]
    slots = [1, 6, 3, 0]
    for s in slots:
        _new(state, s)
    state.apply_staged_writes()
    for s in slots:
        model.run(state, prompt, _batch([s], [5], [0]))
    after_prompt = [slab.clone() for slab in state.slabs]
    rejected = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    batch = _batch(slots, [4] * 4, [3] * 4)
    model.run(state, step_tokens.repeat(4, 1), batch)
    state.postprocess(batch, 4 - rejected, rejected)  # type: ignore[arg-type]
    for row, s in enumerate(slots):
        ref = HybridRecurrentModelState(model, {}, 8, torch.device("cpu"))
        for slab, saved in zip(ref.slabs, after_prompt):
            slab.copy_(saved)
        accepted = 4 - int(rejected[row])
        model.run(ref, step_tokens[:accepted], _batch([s], [accepted], [0]))
        for got, want in zip(state.slabs, ref.slabs):
            torch.testing.assert_close(got[:, s], want[:, s], atol=1e-5, rtol=1e-5)
    assert not torch.equal(state.slabs[3][:, slots[0]], state.slabs[3][:, slots[3]])


@torch.no_grad()
def test_a_start_from_a_snapshot_ends_where_a_full_run_ends_for_every_kind() -> None:
    model = _ThreeKinds()
    state = HybridRecurrentModelState(model, {}, 4, torch.device("cpu"))
    state.init_prefix_cache(CacheConfig(mamba_snapshot_slots=3))
    x = torch.randn(8, 16)
    _new(state, 0)
    state.apply_staged_writes()
    state.save_snapshots([StateSnapshot(0, 5, 2)])
    y_full = model.run(state, x, _batch([0], [8], [0]))
    _new(state, 1, computed=5, snapshot=2)
    for slab in state.slabs:
        slab[:, 1].fill_(9.0)  # garbage the restore must overwrite
    state.apply_staged_writes()
    y_tail = model.run(state, x[5:], _batch([1], [3], [0]))
    torch.testing.assert_close(y_tail, y_full[5:], atol=1e-5, rtol=1e-5)
    for slab in state.slabs:
        torch.testing.assert_close(slab[:, 1], slab[:, 0], atol=1e-5, rtol=1e-5)
    assert state.snapshot_bytes == sum(s[:, 0].numel() * s.element_size() for s in state.slabs)


def test_unknown_kind_is_refused_by_name() -> None:
    class _Unknown(torch.nn.Module, RecurrentHybrid):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
            return [RecurrentStateSpec("nope", 1, (StateTensor((2,), None),))]

    with pytest.raises(KeyError, match="unknown recurrent layer kind 'nope'"):
        HybridRecurrentModelState(_Unknown(), {}, 2, torch.device("cpu"))
    with pytest.raises(TypeError, match="RecurrentHybrid"):
        HybridRecurrentModelState(torch.nn.Linear(2, 2), {}, 2, torch.device("cpu"))
