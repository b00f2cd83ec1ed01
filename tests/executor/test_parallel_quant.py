"""Tensor parallelism of FP8 checkpoints in two CPU processes (gloo) against one process: each rank loads its rows
(column layers) or columns (row layers) of every FP8 weight with the matching block or per-channel scales, and the
row layers' partial products are all-reduced. The engine preempts and chunks prefills; greedy tokens must equal
the single-process run token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import random_prompts
from helpers.quant_checkpoints import TP_SPEC, write_quantized
from test_parallel import ENGINE, PARAMS, _shutdown

from framework.entrypoints.llm import LLM

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(4, 5, 30, seed=77)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel"])
def test_fp8_tensor_parallel_2_matches_one_process(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path, TP_SPEC)
    single = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(tmp_path), **ENGINE, tensor_parallel_size=2)
    try:
        o_proj = llm.engine.runner.model.model.layers[0].self_attn.o_proj
        assert tuple(o_proj.weight.shape) == (256, 128), "the driver should hold half of o_proj's input columns"
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in single]
    finally:
        _shutdown(llm)
