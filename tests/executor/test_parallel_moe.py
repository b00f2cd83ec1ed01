"""Tensor and pipeline parallelism of the MoE models in two CPU processes (gloo) against one process.

Each rank holds half of every expert's intermediate dimension (and of the shared expert's), routes every token
itself with the replicated router, and the experts' partial sums are all-reduced. The Qwen2-MoE checkpoint has a
shared expert and a dense layer; the engine preempts and chunks prefills. Greedy tokens must equal the
single-process run token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import random_prompts, save_tiny_checkpoint
from helpers.hf_moe_models import MOE_SPEC_BY_NAME
from test_parallel import ENGINE, PARAMS, _shutdown

from framework.entrypoints.llm import LLM
from framework.layers.parallel.linear import MissingLayer

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(5, 5, 40, seed=4321)


@pytest.mark.usefixtures("one_thread")
def test_moe_tensor_parallel_2_matches_one_process(tmp_path: Path) -> None:
    save_tiny_checkpoint(MOE_SPEC_BY_NAME["qwen2moe-e6k3-shared"], tmp_path)
    single = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    assert sum(o.num_preemptions for o in single) > 0, "the KV cache was meant to be too small: nothing was preempted"
    llm = LLM(str(tmp_path), **ENGINE, tensor_parallel_size=2)
    try:
        moe = llm.engine.runner.model.model.layers[1].mlp
        assert tuple(moe.experts.gate_up_proj.shape) == (6, 2, 16, 64), "the driver should hold half of each expert"
        assert tuple(moe.experts.down_proj.shape) == (6, 64, 16)
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in single]
    finally:
        _shutdown(llm)


@pytest.mark.usefixtures("one_thread")
def test_moe_pipeline_parallel_2_matches_one_process(tmp_path: Path) -> None:
    """Mixtral (Hub names: `block_sparse_moe`, w1/w2/w3) over two pipeline stages: each stage loads only its
    layers' experts and router."""
    save_tiny_checkpoint(MOE_SPEC_BY_NAME["mixtral-e6k2"], tmp_path)
    single = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(tmp_path), **ENGINE, pipeline_parallel_size=2)
    try:
        layers = llm.engine.runner.model.model.layers  # the driver runs the last stage
        assert isinstance(layers[0], MissingLayer) and not isinstance(layers[1], MissingLayer)
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in single]
    finally:
        _shutdown(llm)
