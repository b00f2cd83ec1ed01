"""The fused-MoE Triton kernels against their PyTorch reference (under the interpreter on the CPU), the reference
against HF transformers' own expert loop, and the expert alignment's invariants, on small awkward shapes.

Awkward cases: an expert with no tokens, all tokens on one expert, top-k = number of experts, a single token,
row counts that cross block boundaries, hidden / intermediate sizes that are not multiples of the tiles, and
every launch configuration the heuristic can pick.
"""

from __future__ import annotations

import pytest
import torch

from framework.layers.kernels.fused_moe import (
    MoeLaunchConfig,
    fused_moe,
    fused_moe_reference,
    fused_moe_triton,
    moe_launch_config,
)
from framework.layers.kernels.moe_align import moe_align_reference, moe_align_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles so that the interpreter crosses tile boundaries in every dimension.
SMALL = MoeLaunchConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
CONFIGS = [SMALL, *dict.fromkeys(moe_launch_config(n, 8) for n in (8, 256, 4096))]  # in order (xdist)


def _problem(
    m: int, h: int, i: int, e: int, k: int, dtype: torch.dtype, seed: int, ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """(x [m, h], gate_up [e, 2, i, h], down [e, h, i], weights [m, k], ids [m, k]) with softmax top-k routing
    (or the given expert ids, weighted at random)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    gate_up = torch.randn(e, 2, i, h, generator=g) * h**-0.5
    down = torch.randn(e, h, i, generator=g) * i**-0.5
    probs = torch.softmax(torch.randn(m, e, generator=g) * 2, dim=-1)
    if ids is None:
        weights, ids = probs.topk(k, dim=-1)
    else:
        weights = torch.rand(ids.shape, generator=g)
    return (x.to(DEVICE, dtype), gate_up.to(DEVICE, dtype), down.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE))


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: summation order only. 16-bit: the kernel and the reference round the same intermediates, so
    they differ by a flipped last-bit rounding at most (relative to the output's scale)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
        return
    ulp = 2**-7 if ref.dtype == torch.bfloat16 else 2**-10
    scale = ref.float().pow(2).mean().sqrt().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=4 * ulp, atol=4 * ulp * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "m,h,i,e,k",
    [
        (1, 32, 16, 4, 2),  # a single token
        (7, 48, 40, 6, 2),  # sizes off the tile grid, experts left empty or not
        (5, 32, 24, 3, 3),  # top-k = number of experts: every expert gets every token
        (40, 32, 32, 8, 2),  # 80 rows: several blocks per expert
    ],
)
def test_kernel_matches_reference(dtype: torch.dtype, m: int, h: int, i: int, e: int, k: int) -> None:
    x, gate_up, down, weights, ids = _problem(m, h, i, e, k, dtype, seed=m * 100 + e)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL), ref)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}")
def test_every_launch_config_matches_reference(config: MoeLaunchConfig) -> None:
    x, gate_up, down, weights, ids = _problem(33, 160, 144, 8, 2, torch.float32, seed=3)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=config), ref)


def test_all_tokens_on_one_expert_and_empty_experts() -> None:
    """Every token routed to expert 2 only (k = 1): the other experts get no rows at all."""
    ids = torch.full((20, 1), 2, dtype=torch.int64)
    x, gate_up, down, weights, ids = _problem(20, 32, 16, 5, 1, torch.float32, seed=7, ids=ids)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL), ref)
    # Only expert 2's weights matter: changing another expert changes nothing.
    gate_up[0].mul_(3.0)
    _assert_close(fused_moe_triton(x, gate_up, down, weights, ids, config=SMALL), ref)


def test_int32_expert_ids_and_strided_rows() -> None:
    x, gate_up, down, weights, ids = _problem(9, 32, 16, 4, 2, torch.float32, seed=9)
    wide = torch.zeros(9, 48, device=DEVICE)
    wide[:, 8:40] = x
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    _assert_close(fused_moe_triton(wide[:, 8:40], gate_up, down, weights, ids.int(), config=SMALL), ref)


def test_no_tokens() -> None:
    x, gate_up, down, weights, ids = _problem(0, 32, 16, 4, 2, torch.float32, seed=1)
    assert fused_moe_triton(x, gate_up, down, weights, ids).shape == (0, 32)


def test_kernel_detects_a_misrouted_row() -> None:
    """Negative control: the comparison fails when a row is computed with another expert's weights."""
    x, gate_up, down, weights, ids = _problem(6, 32, 16, 4, 2, torch.float32, seed=5)
    ref = fused_moe_reference(x, gate_up, down, weights, ids)
    wrong = ids.clone()
    wrong[3, 0] = (wrong[3, 0] + 1) % 4
    if (wrong[3, 0] == wrong[3, 1]).item():
        wrong[3, 0] = (wrong[3, 0] + 1) % 4
    out = fused_moe_triton(x, gate_up, down, weights, wrong, config=SMALL)
    assert (out[3] - ref[3]).abs().max().item() > 1e-2
    torch.testing.assert_close(out[:3], ref[:3], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("align_fn", [moe_align_reference, moe_align_triton], ids=["torch", "triton"])
@pytest.mark.parametrize(
    "m,e,k,block_m",
    [
        (1, 8, 2, 16),
        (13, 5, 3, 4),
        (40, 4, 4, 16),
        (9, 128, 8, 16),
        (100, 6, 2, 16),  # 200 rows: the Triton scan crosses chunks of 128 rows
    ],
)
def test_alignment_groups_rows_by_expert(
    align_fn,
    m: int,
    e: int,
    k: int,  # type: ignore[no-untyped-def]
    block_m: int,
) -> None:
    g = torch.Generator().manual_seed(m + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).to(DEVICE)
    align = align_fn(ids, e, block_m)
    n = m * k
    rows, experts = align.sorted_rows.tolist(), align.block_expert.tolist()
    num_padded = int(align.num_padded.item())
    ids = ids.cpu()
    counts = torch.bincount(ids.flatten(), minlength=e)
    assert num_padded == sum(-(-int(c) // block_m) * block_m for c in counts)
    assert num_padded <= len(rows) and len(rows) == len(experts) * block_m
    real = [r for r in rows[:num_padded] if r < n]
    assert sorted(real) == list(range(n)), "every (token, choice) row appears exactly once"
    assert all(r == n for r in rows[num_padded:]), "past the padded total: padding only"
    flat = ids.flatten().tolist()
    for block in range(num_padded // block_m):
        block_rows = [r for r in rows[block * block_m : (block + 1) * block_m] if r < n]
        assert block_rows, "a padded block holds at least one row (experts without rows get no block)"
        assert all(flat[r] == experts[block] for r in block_rows), "a block belongs to one expert"
        assert block_rows == sorted(block_rows), "rows of an expert keep token order"


def test_triton_alignment_equals_reference() -> None:
    """The one-program kernel and the sort give identical buffers (padding and unused blocks included)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 10, (300, 1), generator=g)
    ids[:150] = 3  # one expert with most rows, across chunk boundaries
    ref, got = moe_align_reference(ids, 10, 16), moe_align_triton(ids, 10, 16)
    assert int(got.num_padded) == int(ref.num_padded)
    assert torch.equal(got.sorted_rows, ref.sorted_rows)
    used = int(ref.num_padded) // 16
    assert torch.equal(got.block_expert[:used], ref.block_expert[:used])


def test_reference_matches_hf_expert_loop() -> None:
    """`fused_moe_reference` equals transformers' own `Qwen3MoeExperts` on the same weights and routing
    (its gate_up_proj is [E, 2I, H] with gate first: our [E, 2, I, H] viewed flat)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        hidden_size=32, moe_intermediate_size=24, num_experts=6, num_experts_per_tok=2, hidden_act="silu"
    )
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    x, gate_up, down, weights, ids = _problem(11, 32, 24, 6, 2, torch.float32, seed=11)
    with torch.no_grad():
        experts.gate_up_proj.copy_(gate_up.cpu().reshape(6, 48, 32))
        experts.down_proj.copy_(down.cpu())
        expected = experts(x.cpu(), ids.cpu(), weights.cpu())
    torch.testing.assert_close(
        fused_moe_reference(x, gate_up, down, weights, ids).cpu(), expected, rtol=1e-5, atol=1e-5
    )


def test_dispatcher_uses_the_kernel_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    """`backend="triton"` (`kernels.backend`, the layer ops' setting) runs the kernels; the result is the
    reference's."""
    import framework.layers.kernels.fused_moe as module

    calls: list[int] = []
    kernel = module.fused_moe_triton
    monkeypatch.setattr(module, "fused_moe_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    x, gate_up, down, weights, ids = _problem(4, 32, 16, 4, 2, torch.float32, seed=2)
    _assert_close(
        fused_moe(x, gate_up, down, weights, ids, "triton"), fused_moe_reference(x, gate_up, down, weights, ids)
    )
    assert calls == [1]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "x": a["x"][None]}, "x must be"),
        (lambda a: {**a, "gate_up": a["gate_up"][:, :1]}, "gate_up must be"),
        (lambda a: {**a, "down": a["down"].transpose(1, 2)}, "down must be"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:2]}, "topk_ids must be"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "topk_weights"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "int32 or int64"),
        (lambda a: {**a, "down": a["down"].double()}, "must have x's dtype"),
    ],
)
def test_bad_inputs_name_the_problem(change, message: str) -> None:  # type: ignore[no-untyped-def]
    x, gate_up, down, weights, ids = _problem(4, 32, 16, 4, 2, torch.float32, seed=2)
    args = change({"x": x, "gate_up": gate_up, "down": down, "topk_weights": weights, "topk_ids": ids})
    for fn in (fused_moe_reference, fused_moe_triton):
        with pytest.raises(ValueError, match=message):
            fn(**args)
