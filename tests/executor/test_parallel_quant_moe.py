"""Tensor parallelism of quantized MoE experts in two CPU processes (gloo) against one process.

Each rank holds half of every expert's intermediate dimension, as for 16-bit experts: gate/up's output rows and
down's input columns, each with its part of the scales (FP8 blocks of 128, per-channel rows) or of the INT4 packed
words, scales and zero points (groups of 64 inside each rank's 128 columns). Per-tensor FP8 is checked layer by
layer (tests/models/test_quantized_tensor_parallel.py). The attention projections are quantized too. Greedy
tokens must equal the single-process run token for token.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import random_prompts
from helpers.quant_checkpoints import write_quantized
from helpers.quant_tp import MOE_TP_SPEC
from test_parallel import ENGINE, PARAMS, _shutdown

from framework.entrypoints.llm import LLM

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(3, 5, 30, seed=79)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel", "gptq", "awq", "ct-w4a16"])
def test_quantized_experts_tensor_parallel_2_match_one_process(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path, MOE_TP_SPEC)
    single = LLM(str(tmp_path), **ENGINE).generate(PROMPTS, PARAMS, use_tqdm=False)
    llm = LLM(str(tmp_path), **ENGINE, tensor_parallel_size=2)
    try:
        experts = llm.engine.runner.model.model.layers[1].mlp.experts
        assert experts.expert_dims == (4, 128, 256), "the driver should hold half of each expert"
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in single]
    finally:
        _shutdown(llm)
