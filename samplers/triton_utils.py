"""What every sampler kernel wrapper shares: the dispatch rule and block sizes.

Each kernel `name` has three public functions: `name_reference` (PyTorch, the semantics), `name_triton`
(launches the Triton `_name_kernel`; runs on the CPU under `TRITON_INTERPRET=1`, which tests use) and `name`,
which picks Triton for CUDA tensors and the reference otherwise.
"""

from __future__ import annotations

import torch

from framework.layers.kernels.launch_math import next_power_of_2

MAX_VOCAB_BLOCK = 1024


def use_triton(tensor: torch.Tensor) -> bool:
    """Triton kernels on CUDA tensors; the PyTorch references everywhere else (CPU engine, CPU tests)."""
    return tensor.is_cuda


def vocab_block(vocab_size: int) -> int:
    """Power-of-two block over the vocabulary: the whole row when small, `MAX_VOCAB_BLOCK` otherwise."""
    return max(16, min(MAX_VOCAB_BLOCK, next_power_of_2(vocab_size)))


def small_block(n: int) -> int:
    """Power-of-two block for short per-slot lists (bias entries, stop ids, bad-word tokens)."""
    return max(16, next_power_of_2(max(n, 1)))
