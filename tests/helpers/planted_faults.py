"""Planted faults: the bugs the isolation and equivalence tests claim to catch, installed through monkeypatch.

Each `plant_*` takes a `pytest.MonkeyPatch` and installs one fault; engines built afterwards carry it (the model
binds its attention function when it is built), and undoing the monkeypatch removes it. `test_negative_controls.py`
plants each one and asserts that the tests guarding against it fail. `MRV2_PLANTED_FAULT=<name>` plants one for a
whole pytest session (see `tests/conftest.py`): a mutation run, to see which tests catch it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch


def plant_zero_attention(mp: pytest.MonkeyPatch) -> None:
    """The decoder's attention output is all zeros (both runners, every backend): the context is lost."""
    import framework.models.llama as llama

    real = llama.paged_attention

    def zeroed(query, kv_cache, meta, scale, **kwargs):  # type: ignore[no-untyped-def]
        return torch.zeros_like(real(query, kv_cache, meta, scale, **kwargs))

    mp.setattr(llama, "paged_attention", zeroed)


def plant_zero_triton_attention(mp: pytest.MonkeyPatch) -> None:
    """Only the Triton paged-attention kernel's output is zeroed (the reference is left intact)."""
    import framework.layers.attention.triton_paged_attention as triton_attention

    real = triton_attention.paged_attention

    def zeroed(query, kv_cache, meta, scale, **kwargs):  # type: ignore[no-untyped-def]
        return torch.zeros_like(real(query, kv_cache, meta, scale, **kwargs))

    mp.setattr(triton_attention, "paged_attention", zeroed)


def plant_rows_read_row0_kv(mp: pytest.MonkeyPatch) -> None:
    """Every batch row's attention reads batch row 0's KV blocks (writes still go to its own): requests leak
    into each other whenever two share a step, and a request alone is unaffected."""
    import framework.models.llama as llama

    real = llama.paged_attention

    def leaky(query, kv_cache, meta, scale, **kwargs):  # type: ignore[no-untyped-def]
        row0 = meta.block_tables[:1].expand_as(meta.block_tables).contiguous()  # [R, max_blocks]
        return real(query, kv_cache, dataclasses.replace(meta, block_tables=row0), scale, **kwargs)

    mp.setattr(llama, "paged_attention", leaky)


def plant_v2_gathers_row0_block_table(mp: pytest.MonkeyPatch) -> None:
    """V2 only: the per-step block-table gather gives every batch row the block-table row of batch row 0's
    request (so its KV goes to, and is read from, another request's blocks). V1 builds its tables on the CPU."""
    import framework.batch.block_tables as block_tables

    real = block_tables.gather_block_tables

    def row0(idx_mapping: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        return real(idx_mapping[:1].expand_as(idx_mapping).contiguous(), table)

    mp.setattr(block_tables, "gather_block_tables", row0)


def plant_accept_every_draft_with_probs(mp: pytest.MonkeyPatch) -> None:
    """Verification with draft probabilities accepts every draft (u < p/q never consulted)."""
    import speculators.rejection_sampler as rejection

    real = rejection.verify_probs

    def always(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, candidate = real(*args)
        draft_col = args[5]  # [L] int64, -1 on bonus rows
        return draft_col >= 0, candidate

    mp.setattr(rejection, "verify_probs", always)


def plant_reused_slot_keeps_sampling_params(mp: pytest.MonkeyPatch) -> None:
    """A request slot given to a new request keeps its previous owner's temperature / top-k / top-p / min-p /
    seed: `SamplingParamsState.add_request` writes a slot only the first time."""
    from samplers.states import SamplingParamsState

    real = SamplingParamsState.add_request

    # Kept on the state object itself: keyed by id(), a later engine's state can reuse a freed engine's id and
    # start with its slots marked written, so it never writes a slot at all (CI saw that once).
    def first_time_only(self, req_slot, params, seed):  # type: ignore[no-untyped-def]
        slots = self.__dict__.setdefault("_planted_written_slots", set())
        if req_slot not in slots:
            slots.add(req_slot)
            real(self, req_slot, params, seed)

    mp.setattr(SamplingParamsState, "add_request", first_time_only)


def plant_old_random_tiny(mp: pytest.MonkeyPatch) -> None:
    """`random_tiny` at the old initializer_range 0.02: greedy output echoes the last prompt token."""
    from framework.models.presets import PRESETS

    mp.setitem(PRESETS["random_tiny"], "initializer_range", 0.02)


def planted_targets() -> dict[str, object]:
    """What the faults replace, by name: equal before and after a control, or a fault leaked into later tests."""
    import framework.batch.block_tables as block_tables
    import framework.layers.attention.triton_paged_attention as triton_attention
    import framework.models.llama as llama
    import speculators.rejection_sampler as rejection
    from framework.models.presets import PRESETS
    from samplers.states import SamplingParamsState

    return {
        "llama.paged_attention": llama.paged_attention,
        "triton paged_attention": triton_attention.paged_attention,
        "gather_block_tables": block_tables.gather_block_tables,
        "verify_probs": rejection.verify_probs,
        "SamplingParamsState.add_request": SamplingParamsState.add_request,
        "random_tiny initializer_range": PRESETS["random_tiny"]["initializer_range"],
    }


FAULTS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "zero_attention": plant_zero_attention,
    "zero_triton_attention": plant_zero_triton_attention,
    "rows_read_row0_kv": plant_rows_read_row0_kv,
    "v2_gathers_row0_block_table": plant_v2_gathers_row0_block_table,
    "accept_every_draft_with_probs": plant_accept_every_draft_with_probs,
    "reused_slot_keeps_sampling_params": plant_reused_slot_keeps_sampling_params,
    "old_random_tiny": plant_old_random_tiny,
}
