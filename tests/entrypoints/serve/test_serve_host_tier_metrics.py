"""The host KV tier's counters through `mrv2 serve`'s `/metrics`, for a hybrid model (Jamba): prompts that evict
one another come back from the tier with their recurrent-state snapshots, and `/metrics` reports the snapshot
hits next to the tier's token hits, bytes each way and load latency. The same requests on an in-process engine of
the same config count the same numbers (the engine's own counters), so the export is checked value for value.
"""

from __future__ import annotations

import httpx
import pytest
from helpers.serve_helpers import ServerProcess

from framework import LLM, SamplingParams, load_config

pytestmark = pytest.mark.slow

# Four prompts of 57 tokens (15 blocks of 4 with the output) in a pool of 24 blocks: each evicts the one before.
PROMPTS = [[(37 * i + 11 * k) % 250 + 1 for k in range(57)] for i in range(4)]
ROUNDS = 2
CACHE = {"block_size": 4, "num_blocks": 24, "enable_prefix_caching": True, "host_kv_gib": 0.002}


def _requests() -> list[list[int]]:
    return [prompt + [200 + r] for r in range(ROUNDS) for prompt in PROMPTS]


def _engine_counts() -> dict[str, float]:
    """The tier's counters after the same requests, one by one, on an in-process engine of the served config."""
    config = {"model": {"preset": "jamba-tiny", "max_model_len": 80}, "device": "cpu", "cache": CACHE}
    llm = LLM(config=load_config(config | {"scheduler": {"max_num_seqs": 2}}))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt in _requests():
        llm.generate([prompt], params, use_tqdm=False)
    stats = llm.engine.kv_tier_stats
    return {
        "kv_host_tier_snapshot_hits_total": stats.snapshot_hits,
        "kv_host_tier_hits_total": stats.hit_tokens,
        "kv_host_tier_load_seconds_count": stats.num_loads,
        "kv_host_tier_snapshots": stats.snapshots_held,
    }


def _metrics(server: ServerProcess) -> dict[str, float]:
    """`mrv2:NAME{labels} value` lines as {NAME or NAME{direction}: value}."""
    values = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("mrv2:kv_host_tier"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0].removeprefix("mrv2:")
            if 'direction="' in name_labels:
                name += "{" + name_labels.split('direction="')[1].split('"')[0] + "}"
            values[name] = float(value)
    return values


def test_snapshot_hits_and_the_tier_counters_reach_metrics():
    overrides = [
        "model=jamba-tiny",
        "model.max_model_len=80",
        "scheduler.max_num_seqs=2",
        *(f"cache.{key}={str(value).lower()}" for key, value in CACHE.items()),
    ]
    with ServerProcess(*overrides) as server:
        assert _metrics(server)["kv_host_tier_snapshot_hits_total"] == 0
        model = server.get("/v1/models").json()["data"][0]["id"]
        for prompt in _requests():  # one at a time: the same evictions as the in-process engine
            body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
        served = _metrics(server)
        assert server.stop(timeout=30) == 0
    expected = _engine_counts()
    assert expected["kv_host_tier_snapshot_hits_total"] > 0, "the workload was meant to hit the tier's snapshots"
    assert {name: served[name] for name in expected} == expected
    assert served["kv_host_tier_bytes_total{to_host}"] > 0 and served["kv_host_tier_bytes_total{to_device}"] > 0
    assert served["kv_host_tier_load_seconds_sum"] > 0 and served["kv_host_tier_failed_loads_total"] == 0
