"""The host KV tier's per-layer waits through the engine: each attention layer waits for its own layer's loads.

A step that loads blocks from the tier runs one side-stream part per paged layer; the forward waits for layer i's
part just before layer i (`AttentionMetadata.kv_waits`). On the CPU the side stream runs a part only when the
step's stream waits for it, so a layer that read the cache before its wait would read stale KV. Every paged
attention read is checked: its layer's load has run (never early), and in some read a later layer's load had not
run yet (the loads really are per layer, not one wait before the forward). The tokens equal those of a run without
the tier: eager forwards, CUDA-graph paths (prefill pieces wait per layer between pieces, whole-step replays wait
for every layer first), a Mamba hybrid (Jamba) and Gemma 4 (its own forward; KV-shared layers). Planted faults:
one layer's wait skipped, or a graph replay that does not wait; each is caught by the read check, and the skipped
wait changes the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer
from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint
from helpers.multiturn_workload import contexts, run_turns

from framework import LLM, SamplingParams, load_config
from framework.kv_transfer.host_connector import HostKVConnector
from framework.kv_transfer.side_stream import DeferredSideStream
from framework.layers.attention import backend
from framework.models.setup import kv_bytes_per_block

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 4
NUM_CONVERSATIONS, CONTEXT_LEN, TURNS, MAX_TOKENS = 4, 22, 3, 4
HOST_BLOCKS = 40


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    from test_hf_parity_gemma4 import SPECS as GEMMA4  # tests/models (on the test path)
    from test_hf_parity_gemma4 import save_gemma4_checkpoint
    from test_mamba_hybrid import JAMBA  # tests/model_states (on the test path, as the other hybrid tests use it)

    paths = {name: tmp_path_factory.mktemp(name) for name in ("llama", "jamba", "gemma4")}
    save_tiny_checkpoint(SPEC_BY_NAME["llama"], paths["llama"])
    save_tiny_checkpoint(JAMBA, paths["jamba"])
    save_gemma4_checkpoint(GEMMA4["ple"], paths["gemma4"])  # KV-shared layers read their source layer's cache
    return paths


def _config(path: Path, host_gib: float = 0.0, **sections: dict[str, Any]) -> dict[str, Any]:
    data: dict[str, Any] = {
        "model": {"path": str(path), "preset": None, "dtype": "float32", "max_model_len": 96},
        "runner": {"kind": "v2", "prefill_cuda_graph_sizes": [8, 16]},
        "device": "cpu",
        "cache": {
            "block_size": BLOCK_SIZE,
            "num_blocks": 24,  # fewer than two conversations: every turn evicts the others' blocks
            "enable_prefix_caching": True,
            "mamba_snapshot_slots": 8,
            "host_kv_gib": host_gib,
        },
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 32, "check_invariants": True},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def _host_gib(path: Path) -> float:
    """A tier of HOST_BLOCKS blocks (and, for a hybrid, as many bytes of state snapshots)."""
    llm = LLM(config=load_config(_config(path)))
    return (HOST_BLOCKS + 0.5) * kv_bytes_per_block(llm.engine.loaded, BLOCK_SIZE, 0) * 2 / 2**30


class LayerReads:
    """Wraps the paged attention of the process (the CPU reference) and checks every read of a step that loads."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.engine.runner
        self.pool = runner.kv_connector.pool  # type: ignore[attr-defined]
        assert isinstance(self.pool.stream, DeferredSideStream)
        self.stream: DeferredSideStream = self.pool.stream
        self.layer_of = {cache.data_ptr(): i for i, cache in enumerate(runner.kv_caches)}
        self.early: list[int] = []  # layers read before their load ran
        self.ahead = 0  # reads while the step's last layer was still loading
        self.checked = 0  # reads in steps that load

    def check(self, kv_cache: torch.Tensor) -> None:
        tickets = self.pool.layer_tickets
        if not tickets:
            return
        self.checked += 1
        layer = self.layer_of[kv_cache.data_ptr()]
        if not self.stream.has_run(tickets[layer]):
            self.early.append(layer)
        if not self.stream.has_run(tickets[-1]):
            self.ahead += 1


def _checked_run(
    path: Path, monkeypatch: pytest.MonkeyPatch, graphs: bool = False, **config: Any
) -> tuple[list, LLM, Optional[LayerReads]]:
    """(the workload's tokens per turn, the LLM, its read checks when the tier is on)."""
    llm = LLM(config=load_config(_config(path, **config)))
    if graphs:
        llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    reads = LayerReads(llm) if config.get("host_gib") else None
    if reads is not None:
        reference = backend.paged_attention_reference

        def checked(query, kv_cache, *args, **kwargs):  # type: ignore[no-untyped-def]
            reads.check(kv_cache)
            return reference(query, kv_cache, *args, **kwargs)

        monkeypatch.setattr(backend, "paged_attention_reference", checked)
    outputs, _ = run_turns(llm, contexts(NUM_CONVERSATIONS, CONTEXT_LEN), TURNS, MAX_TOKENS)
    return outputs, llm, reads


@pytest.fixture(scope="module")
def references(checkpoints) -> dict[str, list]:
    """Each model's tokens without the tier."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return {name: _checked_run(path, monkeypatch)[0] for name, path in checkpoints.items()}


@pytest.mark.parametrize("name,graphs", [("llama", False), ("llama", True), ("jamba", False), ("gemma4", False)])
def test_each_layer_reads_after_its_own_load_and_tokens_are_unchanged(
    checkpoints, references, monkeypatch, name, graphs
):
    path = checkpoints[name]
    on, llm, reads = _checked_run(path, monkeypatch, graphs, host_gib=_host_gib(path))
    assert reads is not None and reads.checked > 0, "the workload was meant to load from the tier"
    assert reads.early == []
    assert reads.ahead > 0, "every read waited for every layer: the loads were not per layer"
    assert on == references[name]
    assert llm.engine.kv_tier_stats.hit_tokens > 0 and llm.engine.kv_tier_stats.failed_loads == 0
    if graphs:  # the graph paths ran: prefill pieces and whole-step replays
        assert llm.engine.runner.graphs.prefill_graphs.num_replayed_steps > 0  # type: ignore[union-attr]


def test_negative_control_a_skipped_layer_wait_reads_stale_kv(checkpoints, references, monkeypatch):
    """Planted: the forward skips layer 1's wait (its copies run only when a later wait comes)."""
    wait = HostKVConnector.wait_for_layer_load
    monkeypatch.setattr(HostKVConnector, "wait_for_layer_load", lambda self, layer: layer != 1 and wait(self, layer))
    path = checkpoints["llama"]
    on, _, reads = _checked_run(path, monkeypatch, host_gib=_host_gib(path))
    assert reads is not None and 1 in reads.early
    assert on != references["llama"]


def _one_token_prompt_step(path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LayerReads, int, bool, LLM]:
    """A prompt of 4 blocks + 1 token, evicted to the tier, then asked again alone: its prefix loads from the tier
    and its one remaining token makes a pure-decode-shaped step, which a whole-step graph replays. Returns the
    checks, the replays of that last step, whether its token equals the first time's, and the LLM."""
    llm = LLM(config=load_config(_config(path, host_gib=_host_gib(path))))
    capturer = EagerReplayCapturer()
    llm.engine.runner.capture_cuda_graphs(capturer)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompt = list(range(10, 10 + 4 * BLOCK_SIZE + 1))
    first = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    llm.generate([list(range(100 + 30 * i, 130 + 30 * i)) for i in range(3)], one, use_tqdm=False)  # evicts it
    reads = LayerReads(llm)
    reference = backend.paged_attention_reference
    monkeypatch.setattr(
        backend, "paged_attention_reference", lambda q, kv, *a, **k: (reads.check(kv), reference(q, kv, *a, **k))[1]
    )
    replays = capturer.num_replays
    again = llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids
    return reads, capturer.num_replays - replays, again == first, llm


def test_a_graph_replay_waits_for_every_layer_first(checkpoints, monkeypatch):
    reads, replays, same, llm = _one_token_prompt_step(checkpoints["llama"], monkeypatch)
    assert llm.engine.kv_tier_stats.hit_tokens > 0  # (the prefix's first block may have stayed on the device)
    assert replays > 0 and reads.checked > 0  # the loading step was a replay
    assert reads.early == [] and reads.ahead == 0 and same


def test_negative_control_a_replay_that_does_not_wait_reads_stale_kv(checkpoints, monkeypatch):
    """Planted: graph replays do not wait for the loads (the replay runs every layer, with no hook inside)."""
    monkeypatch.setattr(HostKVConnector, "wait_for_loads", lambda self: None)
    reads, replays, _, _ = _one_token_prompt_step(checkpoints["llama"], monkeypatch)
    assert replays > 0 and sorted(set(reads.early)) == [0, 1]
