"""`model.fuse_rope_attention` in the whole engine, every kernel in Triton's interpreter.

A tiny Qwen3 checkpoint (q/k norms, GQA 2:1; tests/hf_models.py: its greedy continuations depend on the
context) generates the same greedy tokens with the switch on and off, and HF's: decode through "graph replays"
(`EagerReplayCapturer`, tests/fake_graphs.py) at padded and exact batch sizes (padding rows store nothing),
and draft verification of ngram speculation (rows of several tokens). The spy proves the fused launch ran,
on decode rows and on draft-verify rows; prefill keeps the two kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from framework.attention import triton_rope_attention
from framework.config import Mrv2Config
from framework.llm import LLM
from framework.sampling_params import SamplingParams

try:
    from fake_graphs import EagerReplayCapturer
    from hf_models import SPEC_BY_NAME, hf_greedy, random_prompts, save_tiny_checkpoint
except ImportError:  # tests/ collected as a package
    from tests.fake_graphs import EagerReplayCapturer
    from tests.hf_models import SPEC_BY_NAME, hf_greedy, random_prompts, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(3, 3, 12, seed=21)
MAX_TOKENS = [3, 5, 7]  # decode at 3, 2 and 1 rows: graph 4 (one padding row), 2 and 1
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("rope-attention-qwen3")
    return path, save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], path)


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every kernel in Triton (as on CUDA); records `max_query_len` of every fused launch."""
    monkeypatch.setenv("MRV2_ATTENTION_BACKEND", "triton")
    calls: list[int] = []
    kernel = triton_rope_attention.rope_paged_attention

    def spy(*args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        calls.append(args[10].max_query_len)  # meta
        return kernel(*args, **kwargs)

    monkeypatch.setattr(triton_rope_attention, "rope_paged_attention", spy)
    return calls


def _generate(path: Path, fuse: bool, prompts: list[list[int]], max_tokens: list[int], **engine: Any) -> list[list[int]]:
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4, seed=0,
              fuse_rope_attention=fuse, **engine)
    if "speculative_config" not in engine:
        llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_decode_graphs_give_the_same_tokens_on_and_off(checkpoint: Any, fused_calls: list[int]) -> None:
    path, hf_model = checkpoint
    off = _generate(path, False, PROMPTS, MAX_TOKENS)
    assert fused_calls == []
    on = _generate(path, True, PROMPTS, MAX_TOKENS)
    assert on == off == [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    layers = 2
    assert len(fused_calls) >= layers * (max(MAX_TOKENS) - 1) and set(fused_calls) == {1}


def test_draft_verification_gives_the_same_tokens_on_and_off(checkpoint: Any, fused_calls: list[int]) -> None:
    path, hf_model = checkpoint
    prompts = [p + p for p in PROMPTS[:2]]  # repeating prompts: ngram finds drafts
    off = _generate(path, False, prompts, [8, 8], speculative_config=NGRAM, enable_prefix_caching=False)
    on = _generate(path, True, prompts, [8, 8], speculative_config=NGRAM, enable_prefix_caching=False)
    assert on == off == [hf_greedy(hf_model, p, 8) for p in prompts]
    assert max(fused_calls) > 1, "no draft-verify batch took the fused launch"


def test_the_switch_is_off_by_default() -> None:
    assert Mrv2Config().model.fuse_rope_attention is False
