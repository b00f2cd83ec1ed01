"""Prefix caching through the engine: the same tokens with and without it, exact hit counts, prompt logprobs and
embeddings unchanged, configuration errors.

Equality runs use the tiny HF-parity checkpoints (tests/helpers/hf_models.py): requests share a system prefix cut
shorter than a block, at exactly a block, and over many blocks; some repeat a whole prompt; a second wave
continues the first wave's conversations (prompt + output + new tokens, so generated tokens hit too). Half
the requests are greedy, half sample with a seed. Small caches preempt and evict; every step checks the
block pool (`check_invariants`), and at the end every block is free with reference count 0.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import SPEC_BY_NAME, save_tiny_checkpoint
from helpers.leak_check import assert_engine_drained
from helpers.prefix_workload import first_wave, mixed_params

from framework import LLM, SamplingParams, load_config
from framework.config.schema import ConfigError
from framework.params.pooling_params import PoolingParams

MAX_MODEL_LEN = 96
MAX_TOKENS = 10

# (architecture, runner, async scheduling, block size, KV blocks): both runners, both scheduling modes, block
# sizes 1, 4 and 16, each architecture once; the small pools preempt and evict.
CASES = [
    ("llama", "v2", True, 4, 30),
    ("qwen2", "v1", False, 4, 30),
    ("qwen3", "v2", False, 1, 110),
    ("llama-rope-llama3", "v1", True, 16, 8),
    ("mistral", "v2", True, 16, 7),
    ("qwen3", "v1", True, 1, 100),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    paths = {}
    for name in sorted({case[0] for case in CASES}):
        paths[name] = tmp_path_factory.mktemp(name)
        save_tiny_checkpoint(SPEC_BY_NAME[name], paths[name])
    return paths


def _engine_config(
    path: Path, runner: str, async_scheduling: bool, block_size: int, num_blocks: int, caching: bool
) -> dict:
    return {
        "model": {"path": str(path), "preset": None, "dtype": "float32", "max_model_len": MAX_MODEL_LEN},
        "runner": {"kind": runner},
        "device": "cpu",
        "cache": {"block_size": block_size, "num_blocks": num_blocks, "enable_prefix_caching": caching},
        "scheduler": {
            "max_num_seqs": 6,
            "max_num_batched_tokens": 48,
            "async_scheduling": async_scheduling,
            "check_invariants": True,
        },
    }


def _run(config: dict, block_size: int) -> tuple[list[list[int]], int, int, object]:
    llm = LLM(config=load_config(config))
    wave = first_wave(block_size)
    first = llm.generate(wave, mixed_params(len(wave), MAX_TOKENS), use_tqdm=False)
    follow = [o.prompt_token_ids + o.token_ids + [7, 8, 9] for o in first[:4]]  # the conversations go on
    second = llm.generate(follow, mixed_params(len(follow), MAX_TOKENS), use_tqdm=False)
    outs = first + second
    assert_engine_drained(llm.engine)
    kv = llm.engine.kv_cache
    assert all(kv.ref_count(b) == 0 for b in range(kv.num_blocks))
    return (
        [o.token_ids for o in outs],
        sum(o.num_preemptions for o in outs),
        sum(o.num_cached_tokens for o in outs),
        llm.prefix_cache_stats,
    )


@pytest.mark.parametrize(
    "arch,runner,async_scheduling,block_size,num_blocks",
    CASES,
    ids=[f"{c[0]}-{c[1]}-{'async' if c[2] else 'sync'}-bs{c[3]}" for c in CASES],
)
def test_same_tokens_with_and_without_prefix_caching(
    checkpoints, one_thread, arch, runner, async_scheduling, block_size, num_blocks
):
    args = (checkpoints[arch], runner, async_scheduling, block_size, num_blocks)
    off, _, cached_off, stats_off = _run(_engine_config(*args, caching=False), block_size)
    on, preemptions, cached_on, stats_on = _run(_engine_config(*args, caching=True), block_size)
    assert on == off
    assert cached_off == 0 and stats_off.queries == 0
    assert cached_on > 0 and stats_on.hits >= cached_on and 0 < stats_on.hit_rate < 1
    if num_blocks * block_size < 4 * MAX_MODEL_LEN:
        assert preemptions > 0, "the small pool was meant to preempt"


def test_hit_metrics_are_exact(tiny_llm_factory):
    """block_size 4. "a" (10 tokens) misses and publishes its 2 full prompt blocks, then, decoding, the block
    holding its first output tokens. "b" shares 8 tokens; "c" repeats a's prompt (only 9 tokens may hit: 2
    blocks); "d" is a's prompt + output + 1 token (hits 3 blocks: output tokens are cached too)."""
    llm = tiny_llm_factory(block_size=4, async_scheduling=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    a = list(range(10, 20))
    out_a = llm.generate([a], greedy, use_tqdm=False)[0]
    out_b, out_c = llm.generate([a[:8] + [1, 2, 3], a], greedy, use_tqdm=False)
    out_d = llm.generate([a + out_a.token_ids + [5]], greedy, use_tqdm=False)[0]
    assert [o.num_cached_tokens for o in (out_a, out_b, out_c, out_d)] == [0, 8, 8, 12]
    stats = llm.prefix_cache_stats
    assert (stats.queries, stats.hits) == (10 + 11 + 10 + 15, 8 + 8 + 12)
    assert stats.hit_rate == pytest.approx(28 / 46)
    assert out_c.token_ids == out_a.token_ids
    llm.reset_prefix_cache()
    assert llm.generate([a], greedy, use_tqdm=False)[0].num_cached_tokens == 0


def test_prompt_logprobs_cover_the_whole_prompt(tiny_llm_factory):
    """A request asking for prompt logprobs computes its whole prompt even when it is cached, so every prompt
    position is scored (and equals the uncached values); it still publishes its blocks for others."""
    prompt = list(range(30, 60))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    reference = tiny_llm_factory(block_size=4, enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[
        0
    ]
    llm = tiny_llm_factory(block_size=4)
    llm.generate([prompt], greedy, use_tqdm=False)  # caches the prompt's blocks
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and all(entry is not None for entry in out.prompt_logprobs[1:])
    for got, want in zip(out.prompt_logprobs[1:], reference.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        for token in got:
            assert got[token].logprob == pytest.approx(want[token].logprob, abs=1e-5)
    assert out.token_ids == reference.token_ids
    llm.reset_prefix_cache()
    llm.generate([prompt], params, use_tqdm=False)  # publishes
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].num_cached_tokens == 28


def test_embeddings_equal_with_a_cached_prefix(tiny_llm_factory):
    """Mean / CLS pooling compute every prompt token (no cache read); last-token pooling reads the cache."""
    prompt = list(range(40, 70))
    vectors: dict[tuple[bool, str], list[float]] = {}
    for caching in (False, True):
        llm = tiny_llm_factory(block_size=4, enable_prefix_caching=caching)
        llm.generate([prompt + [1, 2]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        for pooling in ("mean", "cls", "last"):
            before = llm.prefix_cache_stats
            vectors[caching, pooling] = llm.encode([prompt], PoolingParams(pooling_type=pooling), use_tqdm=False)[
                0
            ].embedding
            hits = llm.prefix_cache_stats.hits - before.hits
            assert hits == (28 if caching and pooling == "last" else 0), pooling
        assert_engine_drained(llm.engine)
    for pooling in ("mean", "cls", "last"):
        assert vectors[True, pooling] == pytest.approx(vectors[False, pooling], abs=1e-5)


def test_config_resolution(tiny_llm_factory):
    from framework.config.registry import MODEL_STATES
    from model_states.default import DefaultModelState

    assert tiny_llm_factory().engine.kv_cache.enable_prefix_caching  # null: on for decoder-only models
    assert not tiny_llm_factory(enable_prefix_caching=False).engine.kv_cache.enable_prefix_caching

    class NoCacheState(DefaultModelState):
        name = "test-no-prefix-cache"
        supports_prefix_caching = False

    MODEL_STATES.register(NoCacheState.name)(NoCacheState)
    try:
        llm = LLM(config=load_config({"device": "cpu", "model": {"model_state": NoCacheState.name}}))
        assert not llm.engine.kv_cache.enable_prefix_caching  # null: off, with a log line
        with pytest.raises(
            ConfigError, match="cache.enable_prefix_caching=true cannot be served: model state 'test-no-prefix-cache'"
        ):
            LLM(
                config=load_config(
                    {
                        "device": "cpu",
                        "model": {"model_state": NoCacheState.name},
                        "cache": {"enable_prefix_caching": True},
                    }
                )
            )
    finally:
        MODEL_STATES.unregister(NoCacheState.name)


def test_a_failed_step_drops_what_it_published(tiny_llm_factory):
    """Blocks are published when scheduled; if the step then fails they may hold no KV: the cache is dropped."""
    llm = tiny_llm_factory(block_size=4, async_scheduling=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompt = list(range(10, 30))
    reference = llm.generate([prompt], greedy, use_tqdm=False)[0]
    llm.reset_prefix_cache()
    runner = llm.engine.runner
    execute_model = runner.execute_model

    def failing(output):  # type: ignore[no-untyped-def]
        raise RuntimeError("injected fault")

    runner.execute_model = failing
    assert llm.generate([prompt], greedy, use_tqdm=False)[0].finish_reason == "error"
    runner.execute_model = execute_model
    assert llm.engine.kv_cache.num_cached_blocks == 0
    again = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == reference.token_ids
    assert_engine_drained(llm.engine)


def test_prefix_bench_writes_table_json_and_plot(tmp_path, capsys):
    import json

    from framework.entrypoints.bench.prefix import run_prefix_bench

    config = load_config(
        {
            "device": "cpu",
            "cache": {"block_size": 4},
            "bench": {
                "num_requests": 6,
                "shared_prefix_len": 24,
                "input_len": [2, 6],
                "output_len": [2, 4],
                "name": "t",
            },
        }
    )
    off, on = run_prefix_bench(config, tmp_path)
    table = capsys.readouterr().out
    assert "TTFT p50 ms" in table and "(no prefix cache)" in table
    assert off.prefix_cache_queries == 0 and on.prefix_cache_hits >= 5 * 24  # every request after the first
    assert on.input_tokens == off.input_tokens and on.output_tokens == off.output_tokens
    payload = json.loads((tmp_path / "prefix_bench.json").read_text())
    assert [r["prefix_caching"] for r in payload["results"]] == [False, True]
    assert all(r["ttft_p50_s"] > 0 for r in payload["results"])
    assert (tmp_path / "prefix_bench.png").stat().st_size > 0
