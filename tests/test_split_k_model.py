"""The split-K projections (framework/kernels/projections.py) in the whole model, on tiny HF-parity checkpoints, on
the CPU: the GEMM runs in Triton's interpreter, decode runs as "graph replays" (`EagerReplayCapturer`) at batch
sizes 1, 2, 4 and 8, and the prefill forwards are larger than `split_k_max_tokens`. Claims: greedy tokens equal
HF's and the default path's, logits within the HF-parity tolerance, every decode forward ran its four
projections per layer through the kernel while larger forwards did not, the row-parallel shard adds up before
the bias, and the config keys resolve as documented. Negative control: a kernel that drops the SiLU catches.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import framework.kernels.projections as projections
from framework.config import Mrv2Config
from framework.engine_setup import split_k_max_tokens
from framework.kernels.triton_gemm import gemm_triton

try:
    from hf_models import SPEC_BY_NAME, hf_greedy, save_tiny_checkpoint
    from test_small_batch_model import MAX_TOKENS, PROMPTS, _check_logits, _generate, _OtherRank
except ImportError:  # tests/ collected as a package
    from tests.hf_models import SPEC_BY_NAME, hf_greedy, save_tiny_checkpoint
    from tests.test_small_batch_model import MAX_TOKENS, PROMPTS, _check_logits, _generate, _OtherRank

pytestmark = pytest.mark.usefixtures("one_thread")
SPLIT_K_TOKENS = 8  # decode graphs (<= 8 rows) take the kernel; prefill (5 prompts of 3-12 tokens) does not


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])  # q/k norms + tied embeddings; q/k/v bias
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"split-k-{request.param}")
    return path, save_tiny_checkpoint(SPEC_BY_NAME[request.param], path)


@pytest.fixture
def gemm_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, bool]]:
    """The GEMM in Triton (the interpreter), as on CUDA, at a split of 2 (the tiny model's K is one chunk, so
    the rule would not split); records (rows, silu_mul) of every launch."""
    monkeypatch.setattr(projections, "_triton_enabled", lambda *tensors: True)
    calls: list[tuple[int, bool]] = []

    def spy(x: torch.Tensor, weight: torch.Tensor, bias: Any = None, silu_mul: bool = False, counters: Any = None):
        from framework.kernels.triton_gemm import GemmConfig

        calls.append((x.shape[0], silu_mul))
        return gemm_triton(x, weight, bias, silu_mul, counters, GemmConfig(16, 16, 16, 2, 4, 2))

    monkeypatch.setattr(projections, "gemm_triton", spy)
    return calls


def _run(path: Any, split_k: str, **kwargs: Any):  # type: ignore[no-untyped-def]
    return _generate(path, "off", llm_kwargs=dict(split_k_projections=split_k, split_k_max_tokens=SPLIT_K_TOKENS),
                     **kwargs)


def test_split_k_path_matches_hf_and_the_default_path(checkpoint: Any, gemm_calls: list[tuple[int, bool]]) -> None:
    path, hf_model = checkpoint
    default_tokens, _, _ = _run(path, "off")
    assert gemm_calls == []  # off: cuBLAS (F.linear) only
    tokens, logits, llm = _run(path, "on")
    assert tokens == default_tokens == [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS)]
    _check_logits(hf_model, PROMPTS, tokens, logits)
    layers = llm.engine.runner.model.config.num_layers
    assert max(rows for rows, _ in gemm_calls) <= SPLIT_K_TOKENS  # the prefill forwards stayed on F.linear
    for size in (1, 2, 4, 8):  # decode graphs: qkv, o, gate_up (+ SiLU), down per layer, captured and replayed
        assert sum(1 for rows, _ in gemm_calls if rows == size) >= 2 * 4 * layers, f"no split-K replay at {size}"
    assert sum(silu for _, silu in gemm_calls) * 4 == len(gemm_calls)  # one fused SiLU * up of four


def test_a_kernel_that_drops_the_silu_is_caught(checkpoint: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the gate/up projection's SiLU * up replaced by the gate alone."""
    path, hf_model = checkpoint
    monkeypatch.setattr(projections, "_triton_enabled", lambda *tensors: True)

    def no_silu(x: torch.Tensor, weight: torch.Tensor, bias: Any = None, silu_mul: bool = False, counters: Any = None):
        out = gemm_triton(x, weight, bias, False, counters)
        return out[:, : weight.shape[0] // 2].contiguous() if silu_mul else out

    monkeypatch.setattr(projections, "gemm_triton", no_silu)
    prompts, max_tokens = PROMPTS[-1:], [4]
    tokens, logits, _ = _run(path, "on", prompts=prompts, max_tokens=max_tokens, graphs=False)
    with pytest.raises(AssertionError):
        _check_logits(hf_model, prompts, tokens, logits)


def test_row_shard_sums_before_the_bias(gemm_calls: list[tuple[int, bool]]) -> None:
    """o_proj / down as row shards under TP=2: the kernel gives a partial sum, the bias is added once after the
    all-reduce (`RowParallelLinear.forward`), against the whole product."""
    from framework.models.parallel_layers import RowParallelLinear

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(5, 64, generator=g), torch.randn(40, 64, generator=g) / 8, torch.randn(40, generator=g)
    layer = RowParallelLinear(64, 40, bias=True, ctx=_OtherRank(x[:, 32:] @ w[:, 32:].t()))  # type: ignore[arg-type]
    with torch.no_grad():
        layer.weight.copy_(w[:, :32])
        layer.bias.copy_(b)
    layer.split_k = projections.SplitKProjections(8, projections.SplitCounters())
    with torch.no_grad():
        torch.testing.assert_close(layer(x[:, :32].contiguous()), x @ w.t() + b, rtol=1e-5, atol=1e-5)
    assert gemm_calls == [(5, False)]


def test_config_keys_resolve_to_a_token_threshold() -> None:
    def tokens(mode: str, device: str, max_tokens: int = 256) -> int:
        cfg = Mrv2Config.model_validate({"model": {"split_k_projections": mode, "split_k_max_tokens": max_tokens}})
        return split_k_max_tokens(cfg, torch.device(device))

    assert tokens("off", "cpu") == 0 and tokens("auto", "cpu") == 0  # auto: Hopper GPUs only
    assert tokens("on", "cpu") == 256 and tokens("on", "cpu", 64) == 64
    with pytest.raises(ValueError, match="split_k_max_tokens"):
        tokens("on", "cpu", 0)
