"""The host-memory KV tier through the engine: the same tokens with and without it, failed loads recomputed, the
tier's capacity, and what it refuses.

Conversations on a tiny HF-parity checkpoint (its next token depends on its context) go on turn after turn; each
turn's prompt is the whole conversation so far. The device pool holds far fewer blocks than the live
conversations, so their blocks are evicted between turns and come back from the host tier; the tier itself is
smaller than everything evicted, so it evicts least-recently-used blocks too. Every step checks the block pool
(`check_invariants`) and the tier's slots. Half the requests are greedy, half sample with a seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint
from helpers.leak_check import assert_engine_drained
from helpers.multiturn_workload import contexts, run_turns

from framework import LLM, load_config
from framework.config.registry import KV_CONNECTORS
from framework.config.schema import ConfigError
from framework.kv_transfer.host_connector import HostKVConnector
from framework.models.setup import kv_bytes_per_block
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.observer import StepObserver

BLOCK_SIZE = 4
NUM_CONVERSATIONS, CONTEXT_LEN, TURNS, MAX_TOKENS = 5, 26, 3, 5
HOST_BLOCKS = 40  # fewer than the conversations' blocks: the tier evicts too


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    save_tiny_checkpoint(SPEC_BY_NAME["llama"], path)
    return path


def _config(path: Path, host_blocks: int = 0, block_bytes: int = 0, **sections: dict[str, Any]) -> dict:
    data: dict[str, Any] = {
        "model": {"path": str(path), "preset": None, "dtype": "float32", "max_model_len": 96},
        "runner": {"kind": "v2"},
        "device": "cpu",
        "cache": {"block_size": BLOCK_SIZE, "num_blocks": 28, "enable_prefix_caching": True},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 48, "check_invariants": True},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    if host_blocks:  # half a block more than `host_blocks`: the GiB -> bytes rounding keeps exactly that many
        data["cache"]["host_kv_gib"] = (host_blocks + 0.5) * block_bytes / 2**30
    return data


class _TierChecks(StepObserver):
    """After every step: the tier's slots are each free or held once, never more held than its capacity."""

    def __init__(self, llm: LLM) -> None:
        self.index = llm.engine.kv_connector.index  # type: ignore[attr-defined]
        self.max_held = 0

    def on_step(self, output: SchedulerOutput) -> None:
        self.index.check()
        assert len(self.index) <= self.index.capacity
        self.max_held = max(self.max_held, len(self.index))


def _run(
    config: dict, n: int = 1, between_turns=None, fills: bool = True, max_tokens: int = MAX_TOKENS
) -> tuple[list, int, LLM]:
    """(per turn, every sequence's tokens; preemptions; the LLM), after checking the tier at every step."""
    llm = LLM(config=load_config(config))
    checks = _TierChecks(llm) if llm.engine.kv_tier_stats.capacity_blocks else None
    llm.engine.set_observer(checks)
    starts = contexts(NUM_CONVERSATIONS, CONTEXT_LEN)
    hook = (lambda turn: between_turns(llm, turn)) if between_turns is not None else None
    outputs, preemptions = run_turns(llm, starts, TURNS, max_tokens, n, hook)
    assert_engine_drained(llm.engine)
    if checks is not None and fills:
        assert checks.max_held == HOST_BLOCKS, "the workload was meant to fill the tier"
    return outputs, preemptions, llm


def _block_bytes(path: Path, **sections: dict[str, Any]) -> int:
    llm = LLM(config=load_config(_config(path, **sections)))
    return kv_bytes_per_block(llm.engine.loaded, BLOCK_SIZE, llm.engine.runner.num_draft_kv_layers)


@pytest.fixture(scope="module")
def reference(checkpoint) -> list:
    """The default workload's tokens without the tier."""
    return _run(_config(checkpoint))[0]


# (name, config sections, n, max_tokens): async and sync scheduling, chunked prefill (a small budget), preemption
# (a small pool, longer outputs), speculative decoding (n-gram drafts), n > 1, an FP8 KV cache.
CASES = [
    ("async", {"scheduler": {"async_scheduling": True}}, 1, MAX_TOKENS),
    ("chunked-sync", {"scheduler": {"max_num_batched_tokens": 8, "async_scheduling": False}}, 1, MAX_TOKENS),
    ("preempt", {"cache": {"num_blocks": 24}, "scheduler": {"max_num_seqs": 5}}, 1, 12),
    ("ngram", {"speculator": {"method": "ngram", "num_speculative_tokens": 2}}, 1, MAX_TOKENS),
    ("n2", {}, 2, MAX_TOKENS),
    ("fp8", {"cache": {"kv_cache_dtype": "fp8_e5m2"}}, 1, MAX_TOKENS),
]


@pytest.mark.parametrize("name,sections,n,max_tokens", CASES, ids=[c[0] for c in CASES])
def test_same_tokens_with_and_without_the_host_tier(checkpoint, reference, one_thread, name, sections, n, max_tokens):
    plain = name in ("async", "chunked-sync")  # the same tokens as the default workload's
    off = reference if plain else _run(_config(checkpoint, **sections), n, max_tokens=max_tokens)[0]
    block_bytes = _block_bytes(checkpoint, **sections)
    on, preemptions, llm = _run(_config(checkpoint, HOST_BLOCKS, block_bytes, **sections), n, max_tokens=max_tokens)
    assert on == off
    stats = llm.engine.kv_tier_stats
    assert stats.hit_tokens > 0 and stats.failed_loads == 0
    assert stats.bytes_to_device == stats.hit_tokens // BLOCK_SIZE * block_bytes and stats.bytes_to_tier > 0
    assert stats.num_loads > 0 and stats.load_seconds > 0
    assert stats.blocks_held == len(llm.engine.kv_connector.index) <= HOST_BLOCKS  # type: ignore[attr-defined]
    if name == "preempt":
        assert preemptions > 0, "the small pool was meant to preempt"


def _plant(tag: Any):
    """Before the last turn, every host slot claims to hold `tag` (a corrupt block) or nothing (a missing one)."""

    def plant(llm: LLM, turn: int) -> None:
        if turn == TURNS - 1:
            pool = llm.engine.runner.kv_connector.pool  # type: ignore[attr-defined]
            pool.slot_hash[:] = [tag] * len(pool.slot_hash)

    return plant


@pytest.mark.parametrize("tag", [b"corrupt", None], ids=["corrupt", "missing"])
def test_failed_loads_recompute_with_the_same_tokens(checkpoint, reference, one_thread, tag):
    block_bytes = _block_bytes(checkpoint)
    on, _, llm = _run(_config(checkpoint, HOST_BLOCKS, block_bytes), between_turns=_plant(tag), fills=False)
    assert on == reference
    stats = llm.engine.kv_tier_stats
    assert stats.failed_loads > 0 and stats.hit_tokens > 0


def test_negative_control_failed_loads_not_recomputed(checkpoint, reference, one_thread, monkeypatch):
    """Planted: the engine ignores failed loads, so requests read blocks that were never loaded."""
    monkeypatch.setattr("framework.engine.core.recompute_failed_loads", lambda *args: False)
    block_bytes = _block_bytes(checkpoint)
    on, _, llm = _run(_config(checkpoint, HOST_BLOCKS, block_bytes), between_turns=_plant(b"corrupt"), fills=False)
    assert llm.engine.kv_tier_stats.failed_loads > 0
    assert on != reference


def test_negative_control_forward_does_not_wait_for_loads(checkpoint, reference, one_thread, monkeypatch):
    """Planted: the forward's stream does not wait for the side stream (its copies never run)."""
    monkeypatch.setattr("framework.kv_transfer.side_stream.DeferredSideStream.wait", lambda self: None)
    monkeypatch.setattr("framework.kv_transfer.side_stream.DeferredSideStream.wait_for", lambda self, ticket: None)
    block_bytes = _block_bytes(checkpoint)
    on, _, _ = _run(_config(checkpoint, HOST_BLOCKS, block_bytes), fills=False)
    assert on != reference


def test_a_tier_larger_than_host_memory_is_refused_with_the_numbers(checkpoint):
    with pytest.raises(ConfigError, match=r"cache.host_kv_gib=1e\+06 asks for 1000000.00 GiB .* only [0-9.]+ GiB"):
        LLM(config=load_config(_config(checkpoint, cache={"host_kv_gib": 1e6})))


def test_a_tier_smaller_than_one_block_is_refused(checkpoint):
    with pytest.raises(ConfigError, match="holds no KV block"):
        LLM(config=load_config(_config(checkpoint, cache={"host_kv_gib": 1e-9})))


def test_the_tier_needs_prefix_caching(checkpoint):
    with pytest.raises(ConfigError, match="enable prefix caching"):
        LLM(config=load_config(_config(checkpoint, cache={"host_kv_gib": 0.001, "enable_prefix_caching": False})))


class _NoSnapshots(HostKVConnector):
    """A connector that does not carry recurrent-state snapshots (the host tier, with the flag off)."""

    carries_state_snapshots = False


@pytest.mark.parametrize("preset", ["jamba-tiny", "qwen3_5-tiny"])
def test_a_connector_without_snapshots_is_refused_by_name_for_hybrids(preset):
    """Hybrid models keep recurrent-state snapshots at cached block boundaries; a connector that does not carry
    them is refused by the model state's name, with the reason (the host tier carries them:
    tests/model_states/test_host_tier_snapshots.py)."""
    KV_CONNECTORS.register("no_snapshots", _NoSnapshots)
    try:
        with pytest.raises(ConfigError, match=r"model state '\w+' keeps recurrent-state snapshots .* does not carry"):
            LLM(preset, device="cpu", max_model_len=64, host_kv_gib=0.001, kv_connector="no_snapshots")
    finally:
        KV_CONNECTORS.unregister("no_snapshots")
