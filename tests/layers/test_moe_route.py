"""The MoE routing kernel against its reference (softmax, top-k, renormalisation, weight dtype) under the
interpreter, and the reference against transformers' own routers."""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.moe_route import moe_route, moe_route_reference, moe_route_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _logits(t: int, e: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, e, generator=g) * 2).to(DEVICE, dtype)


def _assert_same_choice(logits: torch.Tensor, got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same experts, up to the order of equal probabilities (bf16 logits tie often; `torch.topk` leaves
    their order unspecified): the probabilities at the chosen ids agree position by position, no id twice."""
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(probs.gather(1, got), probs.gather(1, ref))
    assert all(len(set(row)) == len(row) for row in got.tolist())
    if logits.dtype == torch.float32:  # continuous values: no ties, the very same ids
        assert torch.equal(got, ref)


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 6, 6), (5, 60, 4), (9, 128, 8), (3, 5, 1)])
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize(
    "logits_dtype,weight_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)],
)
def test_kernel_matches_reference(
    t: int, e: int, k: int, normalize: bool, logits_dtype: torch.dtype, weight_dtype: torch.dtype
) -> None:
    logits = _logits(t, e, seed=t * e + k, dtype=logits_dtype)
    ref_w, ref_ids = moe_route_reference(logits, k, normalize, weight_dtype)
    got_w, got_ids = moe_route_triton(logits, k, normalize, weight_dtype)
    assert got_ids.dtype == ref_ids.dtype == torch.int64 and got_w.dtype == weight_dtype
    _assert_same_choice(logits, got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=2e-6 if weight_dtype == torch.float32 else 2**-8, atol=1e-7)


def test_ties_take_the_lower_expert_first() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0]], device=DEVICE)
    weights, ids = moe_route_triton(logits, 3, False, torch.float32)
    assert ids.tolist() == [[1, 3, 4]]
    assert torch.allclose(weights, weights[:, :1].expand(1, 3))


def test_strided_rows_and_no_tokens() -> None:
    wide = _logits(4, 20, seed=1)
    ref = moe_route_reference(wide[:, 2:10].contiguous(), 2, True, torch.float32)
    got = moe_route_triton(wide[:, 2:10], 2, True, torch.float32)
    assert torch.equal(got[1], ref[1]) and torch.allclose(got[0], ref[0])
    weights, ids = moe_route_triton(_logits(0, 8, seed=2), 2, True, torch.float32)
    assert weights.shape == ids.shape == (0, 2)


def test_bad_top_k_names_the_problem() -> None:
    for fn in (moe_route_reference, moe_route_triton, moe_route):
        with pytest.raises(ValueError, match="top_k=9 must be between 1 and the number of experts"):
            fn(_logits(2, 8, seed=3), 9, True, torch.float32)


@pytest.mark.parametrize("family", ["Qwen3Moe", "Mixtral"])
def test_reference_matches_hf_router(family: str) -> None:
    """Same weights and ids as transformers' `Qwen3MoeTopKRouter` (renormalised, cast to the logits dtype) and
    `MixtralTopKRouter` (always renormalised, float32)."""
    transformers = pytest.importorskip("transformers")
    if family == "Qwen3Moe":
        config = transformers.Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True)
        router = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(config)
    else:
        config = transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3)
        router = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        x = torch.randn(6, 16, generator=g)
        _, expected_w, expected_ids = router(x)
        logits = torch.nn.functional.linear(x, router.weight)
    weights, ids = moe_route_reference(logits, 3, True, expected_w.dtype)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_w)
