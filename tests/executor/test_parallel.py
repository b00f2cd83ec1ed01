"""Tensor and pipeline parallelism in two CPU processes (gloo) against one process, on an HF-parity model.

The test process is the driver; mrv2 spawns the other rank. The Qwen3 tiny checkpoint has grouped-query
attention, q/k norms and tied embeddings (so the last pipeline stage loads its LM head from the embedding).
The engine runs with a KV cache small enough to preempt and a token budget small enough to chunk prefills.
Greedy tokens must equal the single-process run token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint

from framework.entrypoints.llm import LLM
from framework.layers.parallel.linear import MissingLayer
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(5, 5, 40, seed=1234)
PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# 24 blocks of 4 tokens hold one request of max_model_len: 5 requests must preempt; 8 tokens per step chunk prefills.
ENGINE = dict(
    device="cpu", dtype="float32", max_model_len=96, block_size=4, num_kv_blocks=24, max_num_batched_tokens=8, seed=0
)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("parallel-qwen3")
    save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], path)
    return path


@pytest.fixture(scope="module")
def single(qwen3: Path) -> list[tuple[list[int], int]]:
    outs = LLM(str(qwen3), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0, "the KV cache was meant to be too small: nothing was preempted"
    return [(o.token_ids, o.num_preemptions) for o in outs]


def _run_parallel(path: Path, **sizes: int) -> tuple[list[tuple[list[int], int]], LLM]:
    llm = LLM(str(path), **ENGINE, **sizes)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.token_ids, o.num_preemptions) for o in outs], llm


def _shutdown(llm: LLM) -> None:
    procs = llm.engine.runner._workers.procs
    llm.shutdown()
    assert [p.exitcode for p in procs] == [0] * len(procs), "a worker did not exit cleanly"


@pytest.mark.usefixtures("one_thread")
def test_tensor_parallel_2_matches_one_process(qwen3: Path, single: list) -> None:
    got, llm = _run_parallel(qwen3, tensor_parallel_size=2)
    try:
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1), "the driver should hold half the heads"
        assert llm.engine.runner.kv_caches[0].shape[3] == 1, "the KV cache holds this rank's KV heads only"
        assert got == single
        # The engine keeps serving after a run: a second generate on the same ranks agrees too.
        again = llm.generate(PROMPTS[:2], PARAMS, use_tqdm=False)
        assert [o.token_ids for o in again] == [t for t, _ in single[:2]]
    finally:
        _shutdown(llm)


@pytest.mark.usefixtures("one_thread")
def test_pipeline_parallel_2_matches_one_process(qwen3: Path, single: list) -> None:
    got, llm = _run_parallel(qwen3, pipeline_parallel_size=2)
    try:
        layers = llm.engine.runner.model.model.layers
        assert isinstance(layers[0], MissingLayer) and not isinstance(layers[1], MissingLayer), (
            "the driver is the last stage"
        )
        assert got == single
    finally:
        _shutdown(llm)


@pytest.mark.usefixtures("one_thread")
def test_a_dead_rank_fails_requests_with_a_clear_error(qwen3: Path) -> None:
    """Killing the other rank does not hang the driver: its requests end with an error naming the cause."""
    llm = LLM(str(qwen3), **ENGINE, tensor_parallel_size=2)
    procs = llm.engine.runner._workers.procs
    try:
        procs[0].kill()
        procs[0].join(10)
        out = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)[0]
        assert out.finish_reason == "error"
        assert "a parallel rank is gone" in (out.error or "")
        assert f"{procs[0].name} exited" in (out.error or ""), "the error should name the rank that left"
    finally:
        llm.shutdown()
