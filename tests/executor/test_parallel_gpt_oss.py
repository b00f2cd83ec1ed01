"""gpt-oss under tensor parallelism in two CPU processes (gloo) against one process, bf16 and MXFP4 experts.

Each rank holds half the attention heads with their sinks and half of every expert's intermediate dimension (MXFP4:
one of the two 32-input blocks of down's inputs), routes every token with the replicated router, and the experts'
partial sums are all-reduced; o_proj's bias and the experts' down bias are added once. The tiny checkpoint is
`test_hf_parity_gpt_oss`'s (window 8 on every other layer, sinks, YaRN, 4 experts top-2, random expert biases) with
`intermediate_size` 64; prompts of 12..40 tokens run past the window, and the engine chunks prefills and preempts.
Greedy tokens equal the one-process run and every prompt logprob is within 1e-4 of it; likewise over two pipeline
stages. Planted in every rank (`helpers.tp_faults`), a bias added per rank (the experts' down bias, or o_proj's
before the all-reduce) breaks the match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.hf_models import random_prompts
from helpers.mxfp4_checkpoints import build_gpt_oss, write_gpt_oss_mxfp4
from helpers.tp_faults import plant_in_every_rank
from helpers.tp_parity import assert_same_outputs
from test_gpt_oss_tensor_parallel import TP_SPEC
from test_parallel import ENGINE, _shutdown

from framework.engine.request import RequestOutput
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # spawns processes

PROMPTS = random_prompts(4, 12, 40, seed=55)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=1)
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    bf16, mxfp4 = tmp_path_factory.mktemp("gpt-oss-tp-bf16"), tmp_path_factory.mktemp("gpt-oss-tp-mxfp4")
    build_gpt_oss(TP_SPEC).save_pretrained(bf16, safe_serialization=True)
    write_gpt_oss_mxfp4(TP_SPEC, mxfp4)
    return {"bf16": bf16, "mxfp4": mxfp4}


def _generate(path: Path, **sizes: int) -> list[RequestOutput]:
    llm = LLM(str(path), **ENGINE, **sizes)
    try:
        if sizes.get("tensor_parallel_size", 1) > 1:
            layer = llm.engine.runner.model.model.layers[0]
            attn, experts = layer.self_attn, layer.mlp.experts
            assert (attn.num_heads, tuple(attn.sinks.shape)) == (2, (2,)), "the driver should hold half the heads"
            assert experts.expert_dims == (4, 32, 64), "the driver should hold half of each expert"
        return llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        if sizes:
            _shutdown(llm)
        else:
            llm.shutdown()


def _check_equal(got: list[RequestOutput], want: list[RequestOutput]) -> float:
    return assert_same_outputs(got, want, PROMPTS, LOGPROB_ATOL)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "experts, layout",
    [("bf16", "tensor_parallel_size"), ("mxfp4", "tensor_parallel_size"), ("mxfp4", "pipeline_parallel_size")],
)
def test_parallel_2_matches_one_process(checkpoints: dict[str, Path], experts: str, layout: str) -> None:
    """Two tensor ranks, or two pipeline stages (two layers each: a window layer and a full one)."""
    single = _generate(checkpoints[experts])
    assert sum(o.num_preemptions for o in single) > 0, "the KV cache was meant to be too small: nothing was preempted"
    worst = _check_equal(_generate(checkpoints[experts], **{layout: 2}), single)
    print(f"max |prompt logprob diff| {layout}=2 vs one process, {experts} experts: {worst:.2e}")


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("fault", ["gpt_oss_down_bias_per_rank", "row_parallel_bias_per_rank"])
def test_a_bias_added_per_rank_breaks_the_match(
    checkpoints: dict[str, Path], fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    single = _generate(checkpoints["bf16"])
    plant_in_every_rank(monkeypatch, fault)
    with pytest.raises(AssertionError):
        _check_equal(_generate(checkpoints["bf16"], tensor_parallel_size=2), single)
