"""MoE routing: softmax over the experts, top-k, optional renormalisation, in one launch per layer.

Semantics (`moe_route_reference`, HF's routers): `probs = softmax(logits.float())`, the k largest of each row
(largest first), divided by their sum when `normalize`, then cast to `weight_dtype` (Qwen applies the weights in
the model dtype, Mixtral in float32). The Triton kernel (`_moe_route_kernel`, one program per token) does the
same in float32 registers; of equal probabilities it takes the lower expert id first (`torch.topk` leaves the
order of ties unspecified). A decode step of a 48-layer MoE model replays this once per layer instead of the
five to six small PyTorch kernels of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.backend import triton_enabled
from framework.layers.kernels.launch_math import next_power_of_2
from framework.layers.kernels.triton_norm_silu import round_to_dtype

MAX_ROUTE_EXPERTS = 4096  # one row of probabilities lives in registers


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [T, E] router logits, row stride stride_l, last dim contiguous
    weights_ptr,  # [T, TOP_K] out: routing weights (weight dtype)
    ids_ptr,  # [T, TOP_K] int64 out: expert ids, largest weight first
    stride_l,
    E: tl.constexpr,
    BLOCK_E: tl.constexpr,  # next power of two >= E
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # next power of two >= TOP_K
    NORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + row * stride_l + experts, mask=experts < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(logits - tl.max(logits, 0))
    p = p / tl.sum(p, 0)  # masked experts: exp(-inf) = 0
    p = tl.where(experts < E, p, -1.0)  # never chosen (probabilities are >= 0)
    slots = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    top_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        choice = tl.min(tl.where(p == best, experts, BLOCK_E), 0)  # the lowest id among equal probabilities
        top_w = tl.where(slots == j, best, top_w)
        top_id = tl.where(slots == j, choice.to(tl.int64), top_id)
        p = tl.where(experts == choice, -1.0, p)
    if NORMALIZE:
        top_w = top_w / tl.sum(tl.where(slots < TOP_K, top_w, 0.0), 0)
    dtype = weights_ptr.dtype.element_ty
    out = row * TOP_K + slots
    tl.store(weights_ptr + out, round_to_dtype(top_w, dtype).to(dtype), mask=slots < TOP_K)
    tl.store(ids_ptr + out, top_id, mask=slots < TOP_K)


def _check(router_logits: torch.Tensor, top_k: int) -> None:
    if router_logits.dim() != 2:
        raise ValueError(f"moe_route: router_logits must be [tokens, experts], got {tuple(router_logits.shape)}")
    if not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(
            f"moe_route: top_k={top_k} must be between 1 and the number of experts ({router_logits.shape[1]})"
        )


def moe_route_reference(
    router_logits: torch.Tensor,  # [T, E] any float dtype
    top_k: int,
    normalize: bool,
    weight_dtype: torch.dtype,
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] weight_dtype, expert ids [T, k] int64): see the module docstring."""
    _check(router_logits, top_k)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weight_dtype), ids


def moe_route_triton(
    router_logits: torch.Tensor,  # [T, E] bf16/fp16/fp32, last dim contiguous
    top_k: int,
    normalize: bool,
    weight_dtype: torch.dtype,  # float32, float16 or bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe_route_reference` in one launch (`_moe_route_kernel`, one program per token)."""
    _check(router_logits, top_k)
    t, e = router_logits.shape
    if router_logits.stride(1) != 1 or e > MAX_ROUTE_EXPERTS:
        raise ValueError(f"moe_route_triton: needs a contiguous last dim and at most {MAX_ROUTE_EXPERTS} experts")
    weights = torch.empty(t, top_k, dtype=weight_dtype, device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=router_logits.device)
    if t:
        _moe_route_kernel[(t,)](
            router_logits,
            weights,
            ids,
            router_logits.stride(0),
            E=e,
            BLOCK_E=next_power_of_2(e),
            TOP_K=top_k,
            BLOCK_K=next_power_of_2(top_k),
            NORMALIZE=normalize,
            num_warps=1,
        )
    return weights, ids


def moe_route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    normalize: bool,
    weight_dtype: torch.dtype,
    backend: str = "auto",  # kernels.backend (framework/layers/kernels/backend.py)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] weight_dtype, expert ids [T, k] int64): the kernel on CUDA (or when forced, like the other
    layer ops), the reference otherwise and for anything autograd must see."""
    kernel_takes = (
        router_logits.dim() == 2
        and router_logits.stride(-1) == 1
        and router_logits.shape[-1] <= MAX_ROUTE_EXPERTS
        and weight_dtype in (torch.float32, torch.float16, torch.bfloat16)
    )
    if kernel_takes and triton_enabled(router_logits.device, router_logits, backend=backend):
        return moe_route_triton(router_logits, top_k, normalize, weight_dtype)
    return moe_route_reference(router_logits, top_k, normalize, weight_dtype)
