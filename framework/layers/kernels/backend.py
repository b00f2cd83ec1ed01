"""Which implementation a kernel dispatcher runs: the Triton kernel or its PyTorch reference.

`MRV2_ATTENTION_BACKEND` overrides the choice for attention and the layer ops alike, so one switch bisects a
numerical difference: `reference` forces the PyTorch path, `triton` forces the kernels (on a CPU only under
`TRITON_INTERPRET=1`), `auto` (default) picks by device: Triton on CUDA, the reference elsewhere.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

BACKEND_ENV = "MRV2_ATTENTION_BACKEND"


def kernel_backend(device: torch.device) -> str:
    """`"triton"` or `"reference"` for tensors on `device` (the environment switch, then the device)."""
    choice = os.environ.get(BACKEND_ENV, "auto").lower()
    if choice not in ("auto", "triton", "reference"):
        raise ValueError(f"{BACKEND_ENV} must be auto, triton or reference, got {choice!r}")
    if choice == "reference" or (choice == "auto" and device.type != "cuda"):
        return "reference"
    return "triton"


def triton_enabled(device: torch.device, *tensors: Optional[torch.Tensor]) -> bool:
    """The kernel backend's choice, except when autograd must see the op: the kernels have no backward, so
    training takes the reference."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return kernel_backend(device) == "triton"


def kernel_fits(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """None, or a tensor of `dtype` whose last dim is contiguous."""
    return t is None or (t.dtype == dtype and t.stride(-1) == 1)
