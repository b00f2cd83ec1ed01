"""Gated DeltaNet hybrids on GPUs: tensor parallelism over 2 GPUs (NCCL, the Triton delta-rule and conv kernels on
each rank's heads, decode CUDA graphs with the all-reduce inside) against one GPU, and a quantized Qwen3-Next
(FP8 block) with its quantized MTP head drafting through draft CUDA graphs against the same run without
speculation. The CPU versions: tests/executor/test_parallel_gdn.py, tests/speculators/test_qwen3_next_quant_mtp.py.

Run: `PYTHONPATH=$PWD python -m pytest -q tests/gpu/test_parallel_gdn_gpu.py` (the TP test needs 2 GPUs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ENGINE = dict(device="cuda", dtype="float32", max_model_len=128, gpu_memory_utilization=0.3)


def _generate(path: Path, prompts: list[list[int]], **kwargs) -> tuple[list[list[int]], dict]:  # type: ignore[no-untyped-def]
    from helpers.cuda_engine import freed_llm

    from framework import SamplingParams

    with freed_llm(path, **ENGINE, **kwargs) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
        stats = llm.engine.spec_metrics.as_dict()
        return [o.token_ids for o in outs], stats


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_gdn_tensor_parallel_2_matches_one_gpu(name: str, tmp_path: Path) -> None:
    from helpers.gdn_models import QWEN3_5, QWEN3_NEXT, slow_decay_checkpoint
    from helpers.hf_models import random_prompts

    slow_decay_checkpoint({"qwen3_5": QWEN3_5, "qwen3_next": QWEN3_NEXT}[name], tmp_path)
    prompts = random_prompts(8, 5, 60, seed=48)
    one_gpu, _ = _generate(tmp_path, prompts)
    tokens, _ = _generate(tmp_path, prompts, tensor_parallel_size=2)
    # fp32: the all-reduce sums two halves in a different order than one GPU's GEMM; allow one late near-tie.
    assert sum(a == b for a, b in zip(tokens, one_gpu)) >= len(one_gpu) - 1


def test_quantized_mtp_head_keeps_greedy_tokens_on_the_gpu(tmp_path: Path) -> None:
    from helpers.gdn_quant import QWEN3_NEXT_QUANT, quantize_mtp, write_quantized_gdn
    from helpers.hf_models import random_prompts
    from helpers.qwen_mtp import fitted_mtp_tensors
    from safetensors.torch import save_file

    model = write_quantized_gdn("fp8-block", QWEN3_NEXT_QUANT, tmp_path, ("mtp.fc",))
    prompts = random_prompts(6, 5, 40, seed=49)
    want, _ = _generate(tmp_path, prompts)
    fitted = fitted_mtp_tensors(tmp_path, model, [p + t for p, t in zip(prompts, want)])
    save_file(quantize_mtp("fp8-block", fitted, ("mtp.fc",))[0], str(tmp_path / "mtp.safetensors"))
    got, stats = _generate(tmp_path, prompts, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    print(f"quantized MTP on the GPU: {stats}")
    assert got == want
    assert stats["num_drafts"] > 0 and stats["per_position_acceptance"][0] > 0.5
