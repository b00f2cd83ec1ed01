"""Which implementation a kernel dispatcher runs: the Triton kernel or its PyTorch reference.

The choice is the config key `kernels.backend` (`KernelBackend`), passed down, never read from a global: the
model loader hands it to the model (`set_kernel_backend`), each layer hands its `kernel_backend` attribute to the
ops it calls (`backend=`), and a dispatcher asks `triton_enabled` / `kernel_backend` with it. `reference` forces the
PyTorch path, `triton` forces the kernels (on a CPU only under `TRITON_INTERPRET=1`), `auto` (every dispatcher's
default, for callers without a config: tests, scripts, training) picks by device: Triton on CUDA, the reference
elsewhere. One setting for attention and the layer ops alike, so one switch bisects a numerical difference.
"""

from __future__ import annotations

from typing import Literal, Optional

import torch
from torch import nn

KernelBackend = Literal["auto", "triton", "reference"]
BACKENDS = ("auto", "triton", "reference")


def kernel_backend(device: torch.device, backend: str = "auto") -> str:
    """`"triton"` or `"reference"` for tensors on `device` under the configured `backend`."""
    if backend not in BACKENDS:
        raise ValueError(f"kernels.backend must be auto, triton or reference, got {backend!r}")
    if backend == "reference" or (backend == "auto" and device.type != "cuda"):
        return "reference"
    return "triton"


def triton_enabled(device: torch.device, *tensors: Optional[torch.Tensor], backend: str = "auto") -> bool:
    """The backend's choice, except when autograd must see the op: the kernels have no backward, so training
    takes the reference."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return False
    return kernel_backend(device, backend) == "triton"


def launch_compiles(device: torch.device) -> bool:
    """Whether a Triton launch on `device` now compiles a missing variant: on a GPU, eagerly (a launch inside a CUDA
    graph capture would be recorded into the graph; the interpreter compiles nothing). The kernels' warm-ups ask
    it before compiling ahead."""
    return device.type == "cuda" and not torch.cuda.is_current_stream_capturing()


def kernel_fits(t: Optional[torch.Tensor], dtype: torch.dtype) -> bool:
    """None, or a tensor of `dtype` whose last dim is contiguous."""
    return t is None or (t.dtype == dtype and t.stride(-1) == 1)


def set_kernel_backend(model: nn.Module, backend: str) -> None:
    """Hand `backend` to every module of `model` that calls a dispatcher (those with a `kernel_backend`
    attribute, "auto" until set); the loader calls it once after the build."""
    kernel_backend(torch.device("cpu"), backend)  # validates the name
    for module in model.modules():
        if hasattr(module, "kernel_backend"):
            module.kernel_backend = backend
