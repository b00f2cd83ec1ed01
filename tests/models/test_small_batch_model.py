"""The small-batch GEMV path in the whole model, on tiny HF-parity checkpoints, on the CPU.

The GEMV kernel runs in Triton's interpreter (the other ops take their references, which their own tests
compare with their kernels), decode runs as "graph replays" (`EagerReplayCapturer`, tests/helpers/fake_graphs.py)
captured at batch sizes 1, 2, 4 and 8, and the requests end one after another (different max_tokens), so
decode runs at 5, 4, 3, 2 and 1 rows: padded graphs (5 -> 8, 3 -> 4) and exact ones. Claims: the GEMV path
(`model.small_batch_kernels=on`) gives HF's greedy tokens and the default path's, its logits are within the
HF-parity tolerance of HF's, every decode graph and every LM head ran the GEMVs, tensor-parallel shards add up,
and the config key resolves as documented. Negative control: a GEMV that loses the residual stream fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer
from helpers.hf_models import SPEC_BY_NAME, hf_greedy, hf_logits, random_prompts, save_tiny_checkpoint

import framework.layers.kernels.small_batch_ops as small_batch_ops
from framework.config.schema import Mrv2Config
from framework.entrypoints.llm import LLM
from framework.layers.kernels.triton_gemv import gemv_triton
from framework.models.setup import small_batch_max_tokens
from framework.models.small_batch import SMALL_BATCH_MAX_TOKENS, enable_small_batch
from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = random_prompts(5, 3, 12, seed=77)
MAX_TOKENS = [2, 3, 4, 5, 6]  # decode batches 5, 4, 3, 2, 1 as the requests end (graphs 8, 4, 4, 2, 1)
LOGITS_ATOL, LOGITS_RTOL = 1e-4, 1e-5  # fp32, as tests/models/test_hf_parity.py (summation order only)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])  # q/k norms + tied embeddings; q/k/v bias
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"small-batch-{request.param}")
    hf_model = save_tiny_checkpoint(SPEC_BY_NAME[request.param], path)
    return path, hf_model


@pytest.fixture
def gemv_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The GEMV in Triton (the interpreter), as on CUDA; records the row count of every GEMV launch."""
    monkeypatch.setattr(small_batch_ops, "triton_enabled", lambda *tensors, backend="auto": True)
    rows: list[int] = []

    def spy(x: torch.Tensor, *args: Any, **kwargs: Any):  # type: ignore[no-untyped-def]
        rows.append(x.shape[0])
        return gemv_triton(x, *args, **kwargs)

    monkeypatch.setattr(small_batch_ops, "gemv_triton", spy)
    return rows


def _generate(
    path: Path,
    small_batch: str,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: list[int] = MAX_TOKENS,
    graphs: bool = True,
) -> tuple[list[list[int]], list[tuple[int, torch.Tensor]], LLM]:
    """(tokens per prompt, (prompt index, logits [vocab]) of every sampled row, the LLM)."""
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_model_len=32,
        max_num_seqs=8,
        seed=0,
        small_batch_kernels=small_batch,
        full_step_cuda_graphs=False,
    )  # the forward-only graphs call the patched compute_logits
    if small_batch == "on":  # every graph size, not just one row (SMALL_BATCH_MAX_TOKENS): the GEMV takes 16
        enable_small_batch(llm.engine.runner.model, 8)
    if graphs:
        llm.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
        assert sorted(llm.engine.runner.graphs.cuda_graphs.graphs) == [(1, 1), (2, 1), (4, 1), (8, 1)]
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


def _check_logits(
    hf_model: torch.nn.Module, prompts: list[list[int]], tokens: list[list[int]], logits: list[tuple[int, torch.Tensor]]
) -> None:
    """Row k of prompt i (prefill, then each decode step) predicts output token k: HF's logits there."""
    for i, (prompt, out) in enumerate(zip(prompts, tokens)):
        rows = [row for j, row in logits if j == i]
        assert len(rows) == len(out)
        reference = hf_logits(hf_model, prompt + out[:-1])
        for k, row in enumerate(rows):
            torch.testing.assert_close(row, reference[len(prompt) - 1 + k], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)


def test_small_batch_path_matches_hf_and_the_default_path(checkpoint: Any, gemv_rows: list[int]) -> None:
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


@pytest.fixture(scope="module")
def qwen3_checkpoint(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("small-batch-control")
    return path, save_tiny_checkpoint(SPEC_BY_NAME["qwen3"], path)


def test_a_gemv_that_loses_the_residual_stream_is_caught(
    qwen3_checkpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: the prologue's `x + residual` output replaced by `x` (the stream drops the residual)."""
    path, hf_model = qwen3_checkpoint
    monkeypatch.setattr(small_batch_ops, "triton_enabled", lambda *tensors, backend="auto": True)

    def lossy(x: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        out, summed = gemv_triton(x, *args, **kwargs)
        return out, (None if summed is None else x.clone())

    monkeypatch.setattr(small_batch_ops, "gemv_triton", lossy)
    prompts, max_tokens = PROMPTS[-1:], [4]
    tokens, logits, _ = _generate(path, "on", prompts, max_tokens, graphs=False)
    with pytest.raises(AssertionError):
        _check_logits(hf_model, prompts, tokens, logits)


def test_config_key_resolves_to_a_token_threshold() -> None:
    def tokens(mode: str, device: str) -> int:
        cfg = Mrv2Config.model_validate({"kernels": {"small_batch": mode}})
        return small_batch_max_tokens(cfg, torch.device(device))

    assert Mrv2Config().kernels.small_batch == "auto"
    assert tokens("off", "cpu") == 0 and tokens("auto", "cpu") == 0  # auto: Hopper GPUs only
    assert tokens("on", "cpu") == SMALL_BATCH_MAX_TOKENS == 1  # measured on the H200
    with pytest.raises(ValueError, match="kernels.small_batch"):  # the retired key names where it went
        Mrv2Config.model_validate({"model": {"small_batch_kernels": "on"}})
    with pytest.raises(ValueError, match="small_batch_max_tokens: removed"):
        Mrv2Config.model_validate({"model": {"small_batch_max_tokens": 8}})


# ---- tensor parallelism --------------------------------------------------------------------------------


class _OtherRank:
    """This rank's view of a 2-rank group whose other rank contributed `other` (a partial sum, or its logits)."""

    tp_size = 2

    def __init__(self, other: torch.Tensor) -> None:
        self.other = other

    def tp_all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        return y + self.other

    def tp_all_gather_last_dim(self, y: torch.Tensor) -> torch.Tensor:
        return torch.cat([y, self.other], dim=-1)


def test_row_shards_sum_before_the_bias_and_vocab_shards_gather(gemv_rows: list[int]) -> None:
    """o_proj / down as row shards (the GEMV gives a partial sum; the bias is added once after the all-reduce)
    and the LM head as vocabulary shards (the last one zero-padded), with the kernel, against the whole layer."""
    from types import SimpleNamespace

    from framework.models.small_batch import _row_parallel, small_batch_logits

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(40, 64, generator=g) / 8, torch.randn(40, generator=g)
    partial_1 = small_batch_ops.fused_linear(x[:, 32:], w[:, 32:].contiguous())[0]
    rank_0 = SimpleNamespace(weight=w[:, :32].contiguous(), bias=b, ctx=_OtherRank(partial_1))
    torch.testing.assert_close(_row_parallel(rank_0, x[:, :32].contiguous()), x @ w.t() + b, rtol=1e-5, atol=1e-5)
    vocab, lm = 51, torch.randn(51, 64, generator=g)
    shard_1 = torch.cat([lm[26:], torch.zeros(1, 64)])  # ceil(51 / 2) = 26 rows per rank
    other_logits = small_batch_ops.fused_linear(x, shard_1)[0]
    head_0 = SimpleNamespace(weight=lm[:26].contiguous(), vocab_size=vocab, ctx=_OtherRank(other_logits))
    logits = small_batch_logits(head_0, x)  # type: ignore[arg-type]
    assert logits.shape == (3, vocab) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, x @ lm.t(), rtol=1e-5, atol=1e-5)
    assert gemv_rows == [3] * 4  # every product above ran the kernel


@pytest.mark.slow  # spawns a rank
def test_tensor_parallel_2_with_small_batch_kernels_matches_one_process(checkpoint: Any) -> None:
    """The wiring under TP=2 on real gloo ranks (the CPU dispatch takes the GEMV's reference there: the kernel's
    shards are covered above): greedy tokens equal a single process on the default path."""
    path, _ = checkpoint
    kwargs = dict(device="cpu", dtype="float32", max_model_len=32, max_num_seqs=8, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    single = [o.token_ids for o in LLM(str(path), **kwargs).generate(PROMPTS, params, use_tqdm=False)]
    llm = LLM(str(path), **kwargs, small_batch_kernels="on", tensor_parallel_size=2)
    try:
        assert llm.engine.runner.model.model.layers[0].small_batch_max_tokens == SMALL_BATCH_MAX_TOKENS
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == single
    finally:
        llm.shutdown()
