"""KV groups (`cache.kv_groups`, docs/sliding-window.md#kv-memory) under tensor parallelism, two CPU processes (gloo).

The tiny gpt-oss of `test_parallel_gpt_oss.py` (window 8 on every other layer: a full group and a window group of
two layers each), 4-token blocks, 8-token chunks. Claims: with two tensor ranks the driver's scheduler runs the
grouped KV manager and every rank's layers read their group's table; greedy tokens equal one process with groups and
HF transformers on prompts of 1.5-5 windows, and every prompt logprob is within 1e-4 of the one-process run; a
request of 40 + 32 tokens (9 windows) holds, at every decode step, one full-group block per position block and at
most window / block + 1 window-group blocks; every block is free afterwards. Planted in the worker rank alone
(`helpers.tp_faults`): its layers read group 0's table, as one table without groups would; the outputs leave
the one-process run's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import hf_greedy, random_prompts
from helpers.mxfp4_checkpoints import build_gpt_oss
from helpers.tp_faults import plant_in_workers
from helpers.tp_parity import assert_same_outputs
from test_gpt_oss_tensor_parallel import TP_SPEC
from test_parallel import _shutdown

from framework.engine.request import RequestOutput
from framework.engine.scheduler.kv_cache_manager import NO_BLOCK
from framework.engine.scheduler.kv_groups import GroupedKVCacheManager
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # spawns processes

WINDOW, BLOCK, MAX_TOKENS = 8, 4, 12
ENGINE = {"device": "cpu", "dtype": "float32", "max_model_len": 96, "block_size": BLOCK, "max_num_batched_tokens": 8}
PROMPTS = random_prompts(3, 12, 40, seed=56)
LONG = PROMPTS[-1]  # 40 tokens; with 32 generated, 9 windows
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """(the checkpoint, HF's greedy tokens per prompt)."""
    path = tmp_path_factory.mktemp("gpt-oss-tp-groups")
    model = build_gpt_oss(TP_SPEC)
    model.save_pretrained(path, safe_serialization=True)
    return path, [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def single(checkpoint: tuple[Path, list[list[int]]]) -> list[RequestOutput]:
    llm = _llm(checkpoint[0], 1)
    try:
        assert llm.engine.runner.kv_groups is not None
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        llm.shutdown()


def _llm(path: Path, tp: int) -> LLM:
    config = config_from_kwargs(str(path), {**ENGINE, "tensor_parallel_size": tp, "seed": 0})
    cache = config.cache.model_copy(update={"kv_groups": True})
    return LLM(config=config.model_copy(update={"cache": cache}))


def _held_per_group(llm: LLM) -> list[tuple[int, int, int]]:
    """(position blocks, full-group blocks held, window-group blocks held) of the one running request at every
    decode step, after its allocation."""
    scheduler, kv = llm.engine.scheduler, llm.engine.kv_cache
    schedule, seen = scheduler.schedule, []

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        for rid, n in zip(out.scheduled_request_ids, out.num_scheduled_tokens):
            if n == 1:
                full, window = kv.blocks_of(rid)[0::2], kv.blocks_of(rid)[1::2]
                seen.append((len(full), sum(b != NO_BLOCK for b in full), sum(b != NO_BLOCK for b in window)))
        return out

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    llm.generate([LONG], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    return seen


def _check_equal(got: list[RequestOutput], want: list[RequestOutput]) -> float:
    return assert_same_outputs(got, want, PROMPTS, LOGPROB_ATOL)


@pytest.mark.usefixtures("one_thread")
def test_tensor_parallel_2_with_groups_matches_one_process_and_hf(
    checkpoint: tuple[Path, list[list[int]]], single: list[RequestOutput]
) -> None:
    assert [list(o.token_ids) for o in single] == checkpoint[1]
    llm = _llm(checkpoint[0], 2)
    try:
        kv = llm.engine.kv_cache
        assert isinstance(kv, GroupedKVCacheManager) and kv.group_windows == (0, WINDOW)
        assert llm.engine.runner.model.model.layers[0].self_attn.num_heads == 2, "the driver holds half the heads"
        worst = _check_equal(llm.generate(PROMPTS, PARAMS, use_tqdm=False), single)
        print(f"max |prompt logprob diff| tp=2 vs one process, KV groups on: {worst:.2e}")
        seen = _held_per_group(llm)
        assert len(seen) >= 30
        assert all(full == position_blocks and window <= WINDOW // BLOCK + 1 for position_blocks, full, window in seen)
        assert seen[-1] == (18, 18, WINDOW // BLOCK + 1)  # 72 positions, 18 blocks; the window from block 15 or 16
        assert kv.num_free_blocks == kv.num_blocks
        kv.check_conservation()
    finally:
        _shutdown(llm)


@pytest.mark.usefixtures("one_thread")
def test_a_rank_reading_one_table_breaks_the_match(
    checkpoint: tuple[Path, list[list[int]]], single: list[RequestOutput], monkeypatch: pytest.MonkeyPatch
) -> None:
    plant_in_workers(monkeypatch, "ungrouped_block_tables")
    llm = _llm(checkpoint[0], 2)
    try:
        with pytest.raises(AssertionError):
            _check_equal(llm.generate(PROMPTS, PARAMS, use_tqdm=False), single)
    finally:
        _shutdown(llm)
