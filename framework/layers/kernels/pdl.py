"""Programmatic dependent launch (PDL, Hopper and newer): whether the decode kernels may use it, and how to ask.

With PDL a kernel launched with the `launch_pdl=True` option may start while the kernel before it on the stream
is still finishing (a CUDA graph captured from the stream keeps that as a programmatic edge). Inside, the kernel
splits in two at `tl.extra.cuda.gdc_wait()`: before it, it may only read what no earlier kernel writes (weights,
constant tables) and must write nothing; after it, every write of the earlier kernels is visible. It then calls
`gdc_launch_dependents()`, which lets the next PDL kernel start (that one blocks in its own `gdc_wait`). The
small-batch GEMV loads its weight tile before the wait, so a layer's weight streaming overlaps the previous
kernel's tail (docs/kernels.md, "Programmatic dependent launch").

A kernel takes a `USE_PDL: tl.constexpr = False`; a wrapper given `pdl=True` launches it with
`**pdl_launch_kwargs(True)`. Whether `pdl` may be true is decided once, at model load (`pdl_supported` /
`resolve_programmatic_launch`, from `kernels.programmatic_launch`), and reaches the kernels as an attribute of the
decoder layers and the model, set by `enable_small_batch` beside `small_batch_max_tokens`: never under Triton's
interpreter (it has no `gdc_*`), never on a CPU or a GPU older than compute capability 9.0, never with a Triton
that lacks the launch option.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

ProgrammaticLaunch = Literal["auto", "on", "off"]


def triton_has_pdl() -> bool:
    """True when the installed Triton has both halves: the `launch_pdl` launch option of the NVIDIA backend and
    `tl.extra.cuda.gdc_wait` / `gdc_launch_dependents` (both in Triton 3.6)."""
    try:
        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    cuda = getattr(getattr(tl, "extra", None), "cuda", None)
    has_gdc = all(hasattr(cuda, name) for name in ("gdc_wait", "gdc_launch_dependents"))
    return has_gdc and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_unsupported_reason(device: torch.device) -> str:
    """Why kernels on `device` cannot use PDL ("" when they can)."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton's interpreter has no gdc_wait / gdc_launch_dependents"
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 9.0 (PDL needs Hopper or newer)"
    if not triton_has_pdl():
        return "this Triton has no launch_pdl launch option or no tl.extra.cuda.gdc_wait"
    return ""


def pdl_supported(device: torch.device) -> bool:
    """Whether Triton kernels on `device` can be launched with PDL (see `pdl_unsupported_reason`)."""
    return not pdl_unsupported_reason(device)


def resolve_programmatic_launch(mode: ProgrammaticLaunch, device: torch.device) -> bool:
    """`kernels.programmatic_launch` on `device`: `off` never; `auto` where supported; `on` the same, but an
    unsupported device is logged as a warning (it was asked for). Unsupported always means off (a kernel with
    `gdc_wait` cannot run under the interpreter, and an old Triton cannot launch it)."""
    if mode == "off":
        return False
    reason = pdl_unsupported_reason(device)
    if reason:
        # Asked for, or a GPU where it was expected (an old Triton, an old GPU): say so; a CPU run stays quiet.
        log = logger.warning if mode == "on" else logger.info if device.type == "cuda" else logger.debug
        log("programmatic dependent launch off: %s (kernels.programmatic_launch=%s)", reason, mode)
        return False
    return True


def pdl_launch_kwargs(pdl: bool) -> dict[str, Any]:
    """Extra launch arguments of a kernel with a `USE_PDL` constexpr: none when off (the kernel's default,
    and no `launch_pdl`, which the interpreter may not take), else the constexpr and the launch option."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl else {}
