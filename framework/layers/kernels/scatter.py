"""Scatter of staged host updates into a state tensor, ordered on the device stream.

Needed for state that lives in pinned host memory but is written by GPU kernels (the token history): a plain
host write could race with a still-running kernel of the previous step that writes the same slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv


def scatter_reference(target: torch.Tensor, flat_index: torch.Tensor, values: torch.Tensor) -> None:
    """target.view(-1)[flat_index] = values (target may be any contiguous tensor)."""
    target.view(-1).index_copy_(0, flat_index.to(target.device), values.to(target.device, target.dtype))


@triton.jit(do_not_specialize=["n"])  # per-step sizes: no recompiles mid-run
def _scatter_kernel(target_ptr, index_ptr, values_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    index = tl.load(index_ptr + i, mask=mask, other=0)
    tl.store(target_ptr + index, tl.load(values_ptr + i, mask=mask), mask=mask)


def scatter_triton(
    target: torch.Tensor,  # contiguous; on the GPU or in pinned host memory (written through unified addressing)
    flat_index: torch.Tensor,  # [N] int64 on the GPU: flat positions in target
    values: torch.Tensor,  # [N] target.dtype on the GPU
) -> None:
    """Triton version of `scatter_reference`, launched on the current stream."""
    n = flat_index.numel()
    if n:
        _scatter_kernel[(cdiv(n, 1024),)](target, flat_index, values, n, BLOCK=1024)
