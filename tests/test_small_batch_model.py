"""The small-batch GEMV path in the whole model, on tiny HF-parity checkpoints, on the CPU.

The GEMV kernel runs in Triton's interpreter (the other ops take their references, which their own tests
compare with their kernels), decode runs as "graph replays" (`EagerReplayCapturer`, tests/fake_graphs.py)
captured at batch sizes 1, 2, 4 and 8, and the requests end one after another (different max_tokens), so
decode runs at 5, 4, 3, 2 and 1 rows: padded graphs (5 -> 8, 3 -> 4) and exact ones. Claims: the GEMV path (`model.small_batch_kernels=on`) gives HF's greedy tokens
and the default path's, its logits are within the HF-parity tolerance of HF's, every decode graph and every LM
head ran the GEMVs, and the config key resolves as documented. Negative control: a GEMV that loses the residual
stream fails the comparison.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import framework.kernels.small_batch_ops as small_batch_ops
from framework.config import Mrv2Config
from framework.engine_setup import small_batch_max_tokens
from framework.kernels.triton_gemv import gemv_triton
from framework.llm import LLM
from framework.sampling_params import SamplingParams

try:
    from fake_graphs import EagerReplayCapturer
    from hf_models import SPEC_BY_NAME, hf_greedy, hf_logits, random_prompts, save_tiny_checkpoint
except ImportError:  # tests/ collected as a package
    from tests.fake_graphs import EagerReplayCapturer
    from tests.hf_models import SPEC_BY_NAME, hf_greedy, hf_logits, random_prompts, save_tiny_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(5, 3, 12, seed=77)
MAX_TOKENS = [2, 3, 4, 5, 6]  # decode batches 5, 4, 3, 2, 1 as the requests end (graphs 8, 4, 4, 2, 1)
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-5  # fp32, as tests/test_hf_parity.py (summation order only)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])  # q/k norms + tied embeddings; q/k/v bias
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"small-batch-{request.param}")
    hf_model = save_tiny_checkpoint(SPEC_BY_NAME[request.param], path)
    return path, hf_model


@pytest.fixture
def gemv_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The GEMV in Triton (the interpreter), as on CUDA; records the row count of every GEMV launch."""
    monkeypatch.setattr(small_batch_ops, "_triton_enabled", lambda *tensors: True)
    rows: list[int] = []

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        rows.append(x.shape[0])
        return gemv_triton(x, *args, **kwargs)

    monkeypatch.setattr(small_batch_ops, "gemv_triton", spy)
    return rows


def _generate(path: Path, small_batch: str, prompts: list[list[int]] = PROMPTS, max_tokens: list[int] = MAX_TOKENS,
              graphs: bool = True) -> tuple[list[list[int]], list[tuple[int, torch.Tensor]], LLM]:
    """(tokens per prompt, (prompt index, logits [vocab]) of every sampled row, the LLM)."""
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=32, max_num_seqs=8, seed=0,
              small_batch_kernels=small_batch)
    if graphs:
        llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
        assert sorted(llm.engine.runner.cuda_graphs.graphs) == [(1, 1), (2, 1), (4, 1), (8, 1)]
    model, scheduler = llm.engine.runner.model, llm.engine.scheduler
    step_ids: list[str] = []
    records: list[tuple[str, torch.Tensor]] = []
    schedule, compute_logits = scheduler.schedule, model.compute_logits

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        step_ids[:] = list(out.scheduled_request_ids)
        return out

    def recording_compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        records.extend((rid, row.clone()) for rid, row in zip(step_ids, logits))
        return logits

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    model.compute_logits = recording_compute_logits  # type: ignore[method-assign]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    index = {o.request_id: i for i, o in enumerate(outs)}
    return [list(o.token_ids) for o in outs], [(index[rid], row) for rid, row in records], llm


def _check_logits(hf_model: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]],
                  logits: list[tuple[int, torch.Tensor]]) -> None:
    """Row k of prompt i (prefill, then each decode step) predicts output token k: HF's logits there."""
    for i, (prompt, out) in enumerate(zip(prompts, tokens)):
        rows = [row for j, row in logits if j == i]
        assert len(rows) == len(out)
        reference = hf_logits(hf_model, prompt + out[:-1])
        for k, row in enumerate(rows):
            torch.testing.assert_close(row, reference[len(prompt) - 1 + k], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_small_batch_path_matches_hf_and_the_default_path(checkpoint, gemv_rows: list[int]) -> None:  # type: ignore[no-untyped-def]
    path, hf_model = checkpoint
    default_tokens, _, _ = _generate(path, "off")
    assert gemv_rows == []  # off: the default path's GEMMs only
    tokens, logits, llm = _generate(path, "on")
    assert tokens == default_tokens == [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    _check_logits(hf_model, PROMPTS, tokens, logits)
    # Decode graphs at 8 (5 rows), 4 (4 and 3), 2 and 1 ran 4 GEMVs per layer at the padded size (capture and
    # replays); the LM head ran on the real rows (prefill: 5 rows; decode: 5..1).
    layers = llm.engine.runner.model.config.num_layers
    for size in (1, 2, 4, 8):
        assert gemv_rows.count(size) >= 2 * 4 * layers, f"no small-batch graph replay at size {size}"
    assert {3, 5} <= set(gemv_rows) and max(gemv_rows) == 8


def test_a_gemv_that_loses_the_residual_stream_is_caught(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Negative control: the prologue's `x + residual` output replaced by `x` (the stream drops the residual)."""
    path, hf_model = checkpoint
    monkeypatch.setattr(small_batch_ops, "_triton_enabled", lambda *tensors: True)

    def lossy(x, weight, bias=None, norm_weight=None, eps=0.0, residual=None, silu_mul=False, out_dtype=None):  # type: ignore[no-untyped-def]
        out, summed = gemv_triton(x, weight, bias, norm_weight, eps, residual, silu_mul, out_dtype)
        return out, (None if summed is None else x.clone())

    monkeypatch.setattr(small_batch_ops, "gemv_triton", lossy)
    prompts, max_tokens = PROMPTS[-1:], [4]
    tokens, logits, _ = _generate(path, "on", prompts, max_tokens, graphs=False)
    with pytest.raises(AssertionError):
        _check_logits(hf_model, prompts, tokens, logits)


def test_config_key_resolves_to_a_token_threshold() -> None:
    def tokens(mode: str, device: str, max_tokens: int = 8) -> int:
        cfg = Mrv2Config.model_validate({"model": {"small_batch_kernels": mode, "small_batch_max_tokens": max_tokens}})
        return small_batch_max_tokens(cfg, torch.device(device))

    assert Mrv2Config().model.small_batch_kernels == "off"  # default until measured on the H200
    assert tokens("off", "cpu") == 0 and tokens("auto", "cpu") == 0  # auto: Hopper GPUs only
    assert tokens("on", "cpu") == 8 and tokens("on", "cpu", 4) == 4
    with pytest.raises(ValueError, match="small_batch_max_tokens"):
        tokens("on", "cpu", 17)  # beyond the kernel's 16 rows
