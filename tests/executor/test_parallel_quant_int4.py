"""Tensor parallelism of INT4 checkpoints (GPTQ with and without act-order, AWQ, compressed-tensors W4A16) in two
CPU processes (gloo) against one process.

Column layers split the packed words, scales and zero points along the output features; row layers split the
packed weight (and GPTQ's g_idx) along the input features and keep the groups their columns use. The tiny model's
down_proj has 320 inputs, 160 per rank: each rank starts or ends mid-group (group 64), and act-order scatters every
group over both ranks. The engine preempts and chunks prefills; greedy tokens must equal the single-process run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import random_prompts
from helpers.quant_checkpoints import write_quantized
from test_parallel import ENGINE, PARAMS, _shutdown

from framework.entrypoints.llm import LLM

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(3, 5, 30, seed=78)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fmt", ["gptq", "gptq-act-asym", "awq", "ct-w4a16"])
def test_int4_tensor_parallel_2_matches_one_process(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path)
    single = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(tmp_path), **ENGINE, tensor_parallel_size=2)
    try:
        mlp = llm.engine.runner.model.model.layers[0].mlp
        assert mlp.down_proj.in_features == 160, "the driver should hold half of down_proj's input columns"
        assert mlp.gate_proj.qweight.shape[0] == 160, "the driver should hold half of gate_proj's output rows"
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in single]
    finally:
        _shutdown(llm)
