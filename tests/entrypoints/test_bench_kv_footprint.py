"""`mrv2 bench`'s KV footprint (framework/entrypoints/bench/kv_footprint.py) on a tiny random Gemma 3 (two 8-token
window layers, one full layer; 4-token blocks), with KV groups on (three groups of one layer) and off (one table of
three layers): two requests of 40 + 32 tokens under 8-token chunked prefill, through `bench_mrv2`.

Claims: the recorded peak blocks and the tokens held at that step equal what docs/sliding-window.md#kv-memory's
rule gives for the steps the scheduler ran (a full group: one block per position block; a window group: the
blocks from the one its window's first key is in, at most ceil((window - 1 + q) / block) + 1 while computing `q`
tokens); the bytes of a block are those of the runner's KV tensors; hence the bytes per token of the two runs are
in the ratio the rule gives (47 blocks of one layer against 35 of three). Planted fault: counting only group 0's
blocks misses the window groups' and fails the rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers.hf_models import TINY_GEMMA3_LAYERS, TINY_GEMMA3_WINDOW, TinySpec, random_prompts, save_tiny_checkpoint

from framework.config.app import BenchConfig
from framework.entrypoints.bench import kv_footprint
from framework.entrypoints.bench.kv_footprint import format_kv_footprint
from framework.entrypoints.bench.throughput import BenchResult, Workload, bench_mrv2
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs

WINDOW, BLOCK, CHUNK = TINY_GEMMA3_WINDOW, 4, 8
SPEC = TinySpec(
    "gemma3-footprint",
    "Gemma3ForCausalLM",
    "Gemma3TextConfig",
    TINY_GEMMA3_LAYERS,
    seed=11,
)
WORKLOAD = Workload(random_prompts(2, 40, 40, seed=5), [32, 32])
BENCH = BenchConfig(num_requests=2, warmup_requests=0, temperature=0.0)
Step = list[tuple[int, int, int]]  # per scheduled row: (tokens computed before, tokens computed, tokens after)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3-footprint")
    save_tiny_checkpoint(SPEC, path)
    return path


def _llm(path: Path, kv_groups: bool) -> LLM:
    base = {"device": "cpu", "dtype": "float32", "max_model_len": 96, "block_size": BLOCK}
    config = config_from_kwargs(str(path), {**base, "max_num_batched_tokens": CHUNK, "max_num_seqs": 2})
    return LLM(
        config=config.model_copy(
            update={
                "cache": config.cache.model_copy(update={"kv_groups": kv_groups}),
                # Synchronous steps: a row's window starts at its first computed token (no token in flight).
                "scheduler": config.scheduler.model_copy(update={"async_scheduling": False}),
            }
        )
    )


def _bench(path: Path, kv_groups: bool) -> tuple[BenchResult, list[Step], LLM]:
    """The workload through `bench_mrv2`, with every step's rows recorded from the scheduler's output."""
    llm = _llm(path, kv_groups)
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        if out.scheduled_request_ids:
            assert out.num_computed_tokens is not None
            assert len(out.scheduled_request_ids) == len(scheduler.running)  # every holder computes this step
            rows = zip(out.num_computed_tokens, out.num_scheduled_tokens)
            steps.append([(before, n, before + n) for before, n in rows])
        return out

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    return bench_mrv2(llm, WORKLOAD, BENCH), steps, llm


def _rule_peak(steps: list[Step], windows: tuple[int, ...]) -> tuple[int, int]:
    """(blocks, tokens) of the step holding the most blocks (then the most tokens) by the docs' rule."""
    best = (0, 0)
    for rows in steps:
        blocks = 0
        for before, q, after in rows:
            position_blocks = -(-after // BLOCK)
            for window in windows:
                held = position_blocks - (max(before - window + 1, 0) // BLOCK if window else 0)
                if window:
                    assert held <= -(-(window - 1 + q) // BLOCK) + 1  # the docs' bound
                blocks += held
        best = max(best, (blocks, sum(after for _, _, after in rows)))
    return best


def _block_bytes(llm: LLM) -> int:
    """Bytes of one block id in the runner's KV tensors (an aliased tensor counted once)."""
    tensors = {cache.data_ptr(): cache for cache in llm.engine.runner.kv_caches}
    return sum(cache[:, 0].numel() * cache.element_size() for cache in tensors.values())


def _mismatches(result: BenchResult, steps: list[Step], windows: tuple[int, ...], llm: LLM) -> list[str]:
    blocks, tokens = _rule_peak(steps, windows)
    want: dict[str, Any] = {
        "kv_peak_blocks": blocks,
        "kv_tokens_at_peak": tokens,
        "kv_block_bytes": _block_bytes(llm),
        "kv_peak_bytes": blocks * _block_bytes(llm),
    }
    return [f"{key}: {getattr(result, key)} != {value}" for key, value in want.items() if getattr(result, key) != value]


@pytest.fixture(scope="module")
def runs(checkpoint: Path) -> dict[bool, tuple[BenchResult, list[Step], LLM]]:
    return {groups: _bench(checkpoint, groups) for groups in (True, False)}


def test_peak_blocks_follow_the_docs_rule_with_and_without_groups(runs: dict) -> None:
    for groups, windows in ((True, (0, WINDOW, WINDOW)), (False, (0,))):
        result, steps, llm = runs[groups]
        assert result.output_tokens == 64 and len(steps) > 30
        assert not _mismatches(result, steps, windows, llm), _mismatches(result, steps, windows, llm)
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.kv_cache.num_blocks
    on, off = runs[True][0], runs[False][0]
    # The peak step: one request at its last decode step (71 tokens, 18 position blocks, 3 per window group),
    # the other 6 tokens behind (65 tokens, 17 position blocks, 3 per window group).
    assert (on.kv_peak_blocks, on.kv_tokens_at_peak) == (18 + 17 + 4 * 3, 71 + 65)
    assert (off.kv_peak_blocks, off.kv_tokens_at_peak) == (18 + 17, 71 + 65)
    assert off.kv_block_bytes == 3 * on.kv_block_bytes  # a block holds one layer with groups, all three without
    assert on.kv_bytes_per_token == pytest.approx(on.kv_peak_bytes / on.kv_tokens_at_peak)
    assert on.kv_bytes_per_token / off.kv_bytes_per_token == pytest.approx(47 / (35 * 3))
    assert "47 blocks x 1024 B" in format_kv_footprint(47, on.kv_block_bytes, on.kv_tokens_at_peak)


def test_planted_fault_counting_group_0_only_breaks_the_rule(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def group0_only(kv: Any) -> int:
        return sum(len(blocks) for blocks in kv.growth_views()[0].values())

    monkeypatch.setattr(kv_footprint, "blocks_in_use", group0_only)
    result, steps, llm = _bench(checkpoint, True)
    assert _mismatches(result, steps, (0, WINDOW, WINDOW), llm)
