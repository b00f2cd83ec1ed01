"""Hybrid models' recurrent-state snapshots in the host KV tier, through the engine.

Tiny HF checkpoints of Jamba (Mamba) and Qwen3.5 (Gated DeltaNet, slow decays so a wrong state shows) run
multi-turn conversations: each turn's prompt is the conversation so far, and the device pool is so small that
every conversation's blocks are evicted between turns. With the host tier, the evicted blocks take their
snapshots along and come back as hits (a hit must end at a block whose snapshot the tier holds). The greedy and
seeded tokens equal those of a run without any prefix caching (async and sync scheduling, chunked prefill,
preemption, n-gram speculative decoding, n > 1); every step checks the block pool, the device snapshot index
and the tier's slots. Planted faults (the snapshot is not restored, or restored from another
block's host slot) change the tokens; a stale host snapshot fails its load, and the request recomputes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from helpers.gdn_models import QWEN3_5, slow_decay_checkpoint
from helpers.hf_models import save_tiny_checkpoint
from helpers.leak_check import assert_engine_drained
from helpers.multiturn_workload import contexts, run_turns
from test_mamba_hybrid import JAMBA

from framework import LLM, load_config
from framework.kv_transfer.build import snapshot_bytes
from framework.kv_transfer.host_snapshots import HostSnapshotPool
from framework.models.setup import kv_bytes_per_block
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.observer import StepObserver

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4
NUM_CONVERSATIONS, CONTEXT_LEN, TURNS, MAX_TOKENS = 4, 26, 3, 8
HOST_BLOCKS = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    paths = {name: tmp_path_factory.mktemp(name) for name in ("jamba", "qwen3_5")}
    save_tiny_checkpoint(JAMBA, paths["jamba"])
    slow_decay_checkpoint(QWEN3_5, paths["qwen3_5"])
    return paths


def _config(path: Path, caching: bool = True, host_gib: float = 0.0, **sections: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": {"path": str(path), "preset": None, "dtype": "float32", "max_model_len": 96},
        "runner": {"kind": "v2"},
        "device": "cpu",
        "cache": {
            "block_size": BLOCK_SIZE,
            "num_blocks": 24,  # fewer than two conversations: every turn evicts the others' blocks
            "enable_prefix_caching": caching,
            "mamba_snapshot_slots": 8,
            "host_kv_gib": host_gib,
        },
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 48, "check_invariants": True},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


class _TierChecks(StepObserver):
    def __init__(self, llm: LLM) -> None:
        self.index = llm.engine.kv_connector.index  # type: ignore[attr-defined]

    def on_step(self, output: SchedulerOutput) -> None:
        self.index.check()


def _run(
    path: Path, between_turns: Optional[Callable[[LLM, int], None]] = None, n: int = 1, **config: Any
) -> tuple[list, LLM]:
    llm = LLM(config=load_config(_config(path, **config)))
    if config.get("host_gib"):
        llm.engine.set_observer(_TierChecks(llm))
    hook = (lambda turn: between_turns(llm, turn)) if between_turns is not None else None
    outputs, preemptions = run_turns(llm, contexts(NUM_CONVERSATIONS, CONTEXT_LEN), TURNS, MAX_TOKENS, n, hook)
    assert_engine_drained(llm.engine)
    assert preemptions > 0 or not config.get("host_gib"), "the small pool was meant to preempt too"
    return outputs, llm


def _host_gib(path: Path) -> float:
    """A tier of HOST_BLOCKS blocks (and as many bytes of snapshots)."""
    llm = LLM(config=load_config(_config(path)))
    block = kv_bytes_per_block(llm.engine.loaded, BLOCK_SIZE, 0)
    assert snapshot_bytes(llm.engine.runner.model_state.snapshot_tensors()) > 0
    return (HOST_BLOCKS + 0.5) * block * 2 / 2**30


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list]:
    """Every model's tokens without prefix caching."""
    return {name: _run(path, caching=False)[0] for name, path in checkpoints.items()}


# (model, case, config sections, n): async scheduling (the default), chunked prefill with sync scheduling,
# n-gram speculative decoding (drafts verified; the state keeps only accepted tokens), n > 1.
CASES = [
    ("jamba", "async", {}, 1),
    ("qwen3_5", "async", {}, 1),
    ("jamba", "chunked-sync", {"scheduler": {"max_num_batched_tokens": 7, "async_scheduling": False}}, 1),
    ("jamba", "ngram", {"speculator": {"method": "ngram", "num_speculative_tokens": 2}}, 1),
    ("qwen3_5", "n2", {}, 2),
]


@pytest.mark.parametrize("name,case,sections,n", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_snapshots_travel_and_hits_give_the_same_tokens(checkpoints, references, name, case, sections, n):
    path = checkpoints[name]
    plain = case in ("async", "chunked-sync")  # the same tokens as the default workload's
    off = references[name] if plain else _run(path, n=n, caching=False, **sections)[0]
    on, llm = _run(path, n=n, host_gib=_host_gib(path), **sections)
    assert on == off
    stats = llm.engine.kv_tier_stats
    assert stats.hit_tokens > 0 and stats.snapshot_hits > 0 and stats.failed_loads == 0
    assert 0 < stats.snapshots_held <= stats.capacity_snapshots and stats.blocks_held <= HOST_BLOCKS


def _not_restored(self: HostSnapshotPool, loads: list) -> None:
    """Planted: the snapshot load copies nothing (the reserved slot keeps whatever it held)."""


def _from_another_block(self: HostSnapshotPool, loads: list) -> None:
    """Planted: the snapshot is restored from the next host slot (another block's snapshot, or none)."""
    moved = [type(t)(t.device_slot, (t.tier_slot + 1) % self.capacity, t.block_hash, t.block_id) for t in loads]
    _load(self, moved)


_load = HostSnapshotPool.load


@pytest.mark.parametrize("fault", [_not_restored, _from_another_block], ids=["not-restored", "another-block"])
@pytest.mark.parametrize("name", ["jamba", "qwen3_5"])
def test_negative_control_a_wrong_snapshot_changes_the_tokens(checkpoints, references, monkeypatch, name, fault):
    monkeypatch.setattr(HostSnapshotPool, "load", fault)
    on, llm = _run(checkpoints[name], host_gib=_host_gib(checkpoints[name]))
    assert llm.engine.kv_tier_stats.snapshot_hits > 0
    assert on != references[name]


def _stale_snapshots(llm: LLM, turn: int) -> None:
    """Before the last turn, every host snapshot slot claims another prefix: their loads fail."""
    if turn == TURNS - 1:
        snapshots = llm.engine.runner.kv_connector.pool.snapshots  # type: ignore[attr-defined]
        snapshots.slot_hash[:] = [b"stale"] * len(snapshots.slot_hash)


def test_a_failed_snapshot_load_recomputes_with_the_same_tokens(checkpoints, references):
    path = checkpoints["jamba"]
    on, llm = _run(path, between_turns=_stale_snapshots, host_gib=_host_gib(path))
    assert on == references["jamba"]
    assert llm.engine.kv_tier_stats.failed_loads > 0
