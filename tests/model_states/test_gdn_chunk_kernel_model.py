"""Tiny Qwen3.5 / Qwen3-Next with the chunked Triton delta-rule kernel (interpreter) doing every non-decode step,
against HF transformers: greedy tokens equal under chunked prefill (step ends inside and across the kernel's
64-token chunks) and under prefix-cache hits (states stored by the kernel as snapshots, restored for the hits).

On the CPU the model normally takes the PyTorch chunked form; here the layer's dispatch is patched so that
prefill, mixed and verification steps run `chunk_gated_delta_rule_varlen_triton` (pure decode keeps the
one-step update). A control breaks the kernel's state carry-over and must change the tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from helpers.gdn_models import QWEN3_5, QWEN3_NEXT, slow_decay_checkpoint
from helpers.hf_models import TinySpec, hf_greedy, random_prompts

import framework.models.gdn_layer as gdn_layer
from framework.entrypoints.llm import LLM
from framework.layers.kernels.gated_delta_rule import gated_delta_rule_varlen
from framework.layers.kernels.gated_delta_rule_chunk import chunk_gated_delta_rule_varlen_triton
from framework.params.sampling_params import SamplingParams

MAX_TOKENS = 6
PROMPTS = random_prompts(2, 66, 74, seed=11)  # longer than one 64-token chunk
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


def _dispatch(fresh_state: bool) -> Callable[..., torch.Tensor]:
    """The layer's dispatch with non-decode steps on the chunked kernel (`fresh_state`: the planted fault of a
    kernel that ignores the slot's state and starts every step from zero)."""

    def run(inp: Any, state: torch.Tensor, idx: torch.Tensor, qsl: torch.Tensor, *rest: Any, **kw: Any) -> torch.Tensor:
        if kw.get("pure_decode"):
            return gated_delta_rule_varlen(inp, state, idx, qsl, *rest, **kw)
        if fresh_state:
            state[idx.long()] = 0.0
        return chunk_gated_delta_rule_varlen_triton(*inp, state, idx, qsl, *rest)

    return run


def _greedy(path: Path, **kwargs: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=128, seed=0, **kwargs)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("spec", [QWEN3_5, QWEN3_NEXT], ids=lambda s: s.name)
def test_chunk_kernel_model_matches_hf(spec: TinySpec, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = slow_decay_checkpoint(spec, tmp_path)
    want = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    monkeypatch.setattr(gdn_layer, "gated_delta_rule_varlen", _dispatch(fresh_state=False))
    assert _greedy(tmp_path, max_num_batched_tokens=23, enable_prefix_caching=False) == want
    if spec is QWEN3_5:  # prefix-cache hits: the second wave starts from the kernel's snapshots
        llm = LLM(
            str(tmp_path), device="cpu", dtype="float32", max_model_len=128, seed=0, block_size=16,
            enable_prefix_caching=True, max_num_batched_tokens=40,
        )  # fmt: skip
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == want
        second = [p + w + [5, 6] for p, w in zip(PROMPTS, want)]
        outs = llm.generate(second, GREEDY, use_tqdm=False)
        assert sum(o.num_cached_tokens or 0 for o in outs) >= 64, "no prefix-cache hit"
        assert [o.token_ids for o in outs] == [hf_greedy(model, p, MAX_TOKENS) for p in second]
        # Control: a kernel that drops the carried state changes the tokens under chunked prefill.
        monkeypatch.setattr(gdn_layer, "gated_delta_rule_varlen", _dispatch(fresh_state=True))
        assert _greedy(tmp_path, max_num_batched_tokens=23, enable_prefix_caching=False) != want
