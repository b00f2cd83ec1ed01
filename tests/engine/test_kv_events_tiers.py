"""KV-cache events beyond the base model on the device (docs/scaling-out.md): blocks computed under a LoRA adapter
carry its `lora_id`, and the blocks a host KV tier takes in and lets go are events with medium "CPU", so that a
subscriber replaying the events knows exactly what each tier holds."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint
from helpers.lora_adapters import ADAPTERS, save_adapter
from helpers.multiturn_workload import contexts, run_turns

from framework import LLM, load_config
from framework.models.setup import kv_bytes_per_block
from framework.params.kv_events import BlockRemoved, BlockStored, EventBatch, KVEventBatch, KVEventRecorder
from framework.params.lora_request import LoRARequest
from framework.params.sampling_params import SamplingParams

BLOCK = 4
HOST_BLOCKS = 30


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("events-llama")
    save_tiny_checkpoint(SPEC_BY_NAME["llama"], path)
    return path


def _wire(events: list) -> list:
    """The events as a subscriber sees them: encoded and decoded as one published batch."""
    payload = msgspec.msgpack.encode(EventBatch(0.0, events))
    return msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events


def test_blocks_of_an_adapter_carry_its_lora_id(checkpoint: Path, tmp_path: Path) -> None:
    adapter = LoRARequest(ADAPTERS[0].name, str(save_adapter(SPEC_BY_NAME["llama"], ADAPTERS[0], tmp_path / "a")))
    llm = LLM(
        str(checkpoint), device="cpu", dtype="float32", max_model_len=64, enable_lora=True,
        enable_prefix_caching=True, block_size=BLOCK,
    )  # fmt: skip
    recorder = KVEventRecorder(BLOCK)
    llm.engine.kv_cache.events = recorder
    prompt = random_prompts(1, 12, 13, seed=3)[0]  # 3 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    seen = []
    for lora in (adapter, None):
        llm.generate([prompt], params, use_tqdm=False, lora_request=lora)
        stored = [e for e in _wire(recorder.take()) if isinstance(e, BlockStored)]
        assert sum(len(e.block_hashes) for e in stored) == 3
        seen.append({e.lora_id for e in stored})
    assert seen == [{adapter.int_id}, {None}]
    assert 0 < adapter.int_id < 2**31 and adapter.int_id != LoRARequest("other", adapter.path).int_id


def _host_llm(checkpoint: Path) -> LLM:
    data = {
        "model": {"path": str(checkpoint), "preset": None, "dtype": "float32", "max_model_len": 96},
        "device": "cpu",
        "cache": {"block_size": BLOCK, "num_blocks": 28, "enable_prefix_caching": True},
        "scheduler": {"max_num_seqs": 3, "max_num_batched_tokens": 48},
    }
    probe = LLM(config=load_config(data))
    block_bytes = kv_bytes_per_block(probe.engine.loaded, BLOCK, probe.engine.runner.num_draft_kv_layers)
    probe.shutdown()
    data["cache"]["host_kv_gib"] = (HOST_BLOCKS + 0.5) * block_bytes / 2**30
    return LLM(config=load_config(data))


def test_host_tier_blocks_are_events_with_medium_cpu(checkpoint: Path) -> None:
    llm = _host_llm(checkpoint)
    recorder = KVEventRecorder(BLOCK)
    llm.engine.kv_cache.events = recorder
    llm.engine.kv_connector.set_kv_events(recorder)
    run_turns(llm, contexts(5, 26), turns=3, max_tokens=5)
    held: dict[str, set[bytes]] = {"GPU": set(), "CPU": set()}
    tokens_known, cpu_removed = set(), 0
    for event in _wire(recorder.take()):
        if isinstance(event, BlockStored):
            if event.medium == "CPU":
                assert event.token_ids == [] and event.parent_block_hash is None
                assert set(event.block_hashes) <= tokens_known, "a host block the device never announced"
            else:
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                tokens_known.update(event.block_hashes)
            held[event.medium].update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= held[event.medium], "removed a block the tier did not hold"
            held[event.medium].difference_update(event.block_hashes)
            cpu_removed += len(event.block_hashes) * (event.medium == "CPU")
    index = llm.engine.kv_connector.index  # type: ignore[attr-defined]
    assert llm.engine.kv_tier_stats.hit_tokens > 0, "the workload was meant to load from the tier"
    assert cpu_removed > 0, "the workload was meant to fill the tier and evict from it"
    assert held["CPU"] == set(index._slot_of)
    assert held["GPU"] == llm.engine.kv_cache.cached_block_hashes()
