"""The KV cache's element type: the model's dtype, or FP8 (`cache.kv_cache_dtype`), and the cast into it.

An FP8 cache holds each K and V element in one byte: half the memory of bf16 (twice the blocks, twice the
tokens in flight) and half the bytes a decode step's attention reads, which is what bounds a large decode batch
(docs/kernels.md, "FP8 KV cache"). The cast has no scale (a scale of 1, what vLLM uses when a checkpoint brings
none) and saturates: a value beyond the format's largest finite one is stored as that value, never as NaN or
infinity. Attention reads the bytes back into the query's dtype before every product, so only the stored K and V
are rounded; q, the scores, the softmax and the accumulation keep their precision.

`cast_to_cache` (Triton) and `saturating_cast` (PyTorch) are the same function: both clamp in float32 and round
to nearest even once, so every store kernel writes the bytes its PyTorch reference writes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_DTYPES: dict[str, torch.dtype] = {  # "fp8" is e4m3: more mantissa, the format vLLM means by it too
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn (cast_to_cache spells it out: a Triton kernel's literal)
FP8_E5M2_MAX = 57344.0  # largest finite float8_e5m2
FP8_MAX: dict[torch.dtype, float] = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.float8_e5m2: FP8_E5M2_MAX}


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` is one of the FP8 types `cache.kv_cache_dtype` names."""
    return dtype in FP8_MAX


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for `cache.kv_cache_dtype` = `name`: `model_dtype` for "auto"."""
    if name == "auto":
        return model_dtype
    if name not in FP8_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r}: expected auto, {', '.join(FP8_DTYPES)}")
    return FP8_DTYPES[name]


def saturating_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`; for an FP8 dtype clamped to its finite range first (in float32, then rounded once)."""
    limit = FP8_MAX.get(dtype)
    if limit is None:
        return x.to(dtype)
    return x.float().clamp(-limit, limit).to(dtype)


@triton.jit
def cast_to_cache(x, cache_dtype: tl.constexpr):
    """`x` (any float dtype) as `cache_dtype`, saturated to the finite range when that is an FP8 type."""
    if cache_dtype == tl.float8e4nv:
        return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(cache_dtype)
    elif cache_dtype == tl.float8e5:
        return tl.clamp(x.to(tl.float32), -57344.0, 57344.0).to(cache_dtype)
    else:
        return x.to(cache_dtype)
