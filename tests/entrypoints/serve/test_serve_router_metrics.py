"""What routers read from `mrv2 serve` (docs/scaling-out.md): the model-server protocol's gauges and counters
under `vllm:` names (`serve.metrics_names=vllm`), the cache layout, `/load` and `/health`, parsed with the
Prometheus client's own parser; and what SGLang's gateway asks a worker it registers (`/server_info`,
`/model_info` and their older `/get_` names)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.serve_helpers import module_server, openai_client
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
BLOCK = 4
PREFIX = "The quick brown fox jumps over the lazy dog and then the quick brown fox runs"

server = module_server("serve.metrics_names=vllm", f"cache.block_size={BLOCK}", "cache.enable_prefix_caching=true")


def _samples(server) -> dict[str, list]:  # type: ignore[no-untyped-def]
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_protocol_names_cache_layout_and_prefix_counters(server):
    client = openai_client(server)
    before = _samples(server)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
    ):
        assert name in before, name
    assert not any(name.startswith("mrv2:") for name in before)
    (info,) = before["vllm:cache_config_info"]
    assert info.labels["block_size"] == str(BLOCK)
    num_blocks = int(info.labels["num_gpu_blocks"])
    assert before["vllm:kv_cache_blocks_total"][0].value == num_blocks
    hits0 = before["vllm:prefix_cache_hits_total"][0].value
    first = client.completions.create(model="tiny", prompt=PREFIX, max_tokens=2)
    second = client.completions.create(model="tiny", prompt=PREFIX + " away", max_tokens=2)
    assert first.usage.prompt_tokens >= 2 * BLOCK
    after = _samples(server)
    hits = after["vllm:prefix_cache_hits_total"][0].value - hits0
    # the second prompt starts with the first one's full blocks: at least those tokens are hits
    assert hits >= (first.usage.prompt_tokens // BLOCK) * BLOCK - BLOCK, hits
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert after["vllm:num_requests_running"][0].value == 0


def test_load_and_health(server):
    load = server.get("/load").json()
    assert load["server_load"] == 0 and load["num_requests_waiting"] == 0
    assert [r["rank"] for r in load["data_parallel"]] == [0] and load["data_parallel"][0]["alive"]
    health = server.get("/health")
    assert health.status_code == 200 and "x-mrv2-degraded" not in health.headers
    assert [m["id"] for m in server.get("/v1/models").json()["data"]] == ["tiny"]


def test_sglang_gateway_worker_metadata(server):
    info = server.get("/server_info").json()
    assert server.get("/get_server_info").json() == info
    (cache,) = _samples(server)["vllm:cache_config_info"]
    assert info["max_total_num_tokens"] == int(cache.labels["num_gpu_blocks"]) * BLOCK and info["page_size"] == BLOCK
    assert (info["served_model_name"], info["tp_size"], info["dp_size"], info["disaggregation_mode"]) == (
        "tiny", 1, 1, "null"
    )  # fmt: skip
    checkpoint = Path(info["model_path"])
    assert info["tokenizer_path"] == str(checkpoint) and (checkpoint / "tokenizer.json").is_file()
    model = server.get("/model_info").json()
    assert server.get("/get_model_info").json() == model
    hf = json.loads((checkpoint / "config.json").read_text())
    assert (model["model_type"], model["architectures"]) == (hf["model_type"], hf["architectures"])
    assert model["is_generation"] and model["model_path"] == info["model_path"]
    (card,) = server.get("/v1/models").json()["data"]
    assert model["max_context_length"] == info["context_length"] == card["max_model_len"]


def test_the_app_runs_in_another_asgi_host():
    """`serving_app` (what the Ray Serve example mounts): the host runs its lifespan, which starts the engine."""
    from fastapi.testclient import TestClient

    from framework.config.schema import load_config
    from framework.entrypoints.serve.server import serving_app

    config = load_config({"model": {"preset": "random_tiny", "max_model_len": 64}, "device": "cpu"})
    with TestClient(serving_app(config)) as http:
        assert http.get("/health").status_code == 200
        out = http.post("/v1/completions", json={"model": "random_tiny", "prompt": "hi", "max_tokens": 3})
        assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
        assert http.get("/load").json()["server_load"] == 0
        info = http.get("/server_info").json()  # random weights: no checkpoint directory for a gateway to read
        assert (
            info["model_path"] is None and info["tokenizer_path"] is None and info["served_model_name"] == "random_tiny"
        )
