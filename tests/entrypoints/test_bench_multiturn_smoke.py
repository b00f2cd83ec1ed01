"""`mrv2 bench experiment=multiturn` composed from conf/ and run on the CPU at a tiny scale: both engines run
every turn, the tier's run loads the later turns' prefixes from host memory and generates the same tokens, and the
table, JSON and plot are written."""

from __future__ import annotations

import json
from pathlib import Path

from framework.config.schema import load_config
from framework.entrypoints.bench.multiturn import device_pool_blocks, run_multiturn_bench

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path):  # type: ignore[no-untyped-def]
    from hydra import compose, initialize_config_dir

    overrides = [
        "experiment=multiturn",
        "model=random_tiny",
        "device=cpu",
        "model.max_model_len=128",
        "cache.block_size=4",
        "scheduler.max_num_seqs=4",
        "scheduler.max_num_batched_tokens=64",
        "bench.num_requests=4",
        "bench.num_turns=3",
        "bench.context_len=40",
        "bench.input_len=[3,3]",
        "bench.output_len=[4,4]",
        "bench.host_kv_gib=0.01",
        "bench.kv_pool_fraction=0.5",
        "bench.warmup_requests=1",
        f"bench.output_dir={tmp_path}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return load_config(compose(config_name="bench", overrides=overrides))


def test_multiturn_bench_runs_both_engines_and_writes_its_results(tmp_path, one_thread, capsys):
    config = _config(tmp_path)
    assert config.bench.name == "multiturn" and config.cache.enable_prefix_caching
    assert device_pool_blocks(config) == 32  # half of 4 conversations of 61 tokens: 31 blocks; one request: 32
    off, on = run_multiturn_bench(config, tmp_path)
    assert on.tokens == off.tokens and len(on.tokens) == 4 * 3
    assert off.tier["hit_tokens"] == 0 and on.tier["hit_tokens"] > 0 and on.tier["failed_loads"] == 0
    assert len(on.ttft_p50_by_turn_s) == 3 and on.ttft_p50_later_s is not None
    assert on.input_tokens == off.input_tokens and on.output_tokens == 4 * 3 * 4
    data = json.loads((tmp_path / "multiturn.json").read_text())
    assert [r["engine"] for r in data["results"]] == ["host tier off", "host tier on"]
    assert "tokens" not in data["results"][0] and data["results"][1]["tier"]["bytes_to_device"] > 0
    assert (tmp_path / "multiturn.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "TTFT p50 t2+ ms" in out and "host tier off/on" in out
