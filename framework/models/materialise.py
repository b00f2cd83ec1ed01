"""Build a model's module tree without storage, then allocate each weight once in the serving dtype.

Constructing an `nn.Module` on its device in float32 and casting it afterwards peaks at the float32 model
(2x a bf16 model's bytes, plus `nn.Linear`'s init kernels that the loader overwrites anyway). Here the tree is
built on the meta device (shapes only), and every parameter then gets uninitialised storage of the target
dtype on the target device, one tensor at a time: the peak is the weights themselves. The values a
constructor computes into buffers (RoPE frequencies) are lost on the meta device, so a model with buffers
recomputes them in `init_buffers()`; a model that has buffers but no such method is built the old way
(on the device, then cast), with a warning, so a third-party model never runs on garbage buffers.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _serving_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """`dtype` for floating tensors, the tensor's own dtype otherwise (what `Module.to(dtype=...)` does)."""
    return dtype if tensor.is_floating_point() else tensor.dtype


def _allocate_parameters(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one of the serving dtype on `device`; tied parameters
    (one `nn.Parameter` under two names) stay one parameter. The parameters a module names in `keep_dtype` (a
    quantized layer's FP8 weight and float32 scales) keep their own dtype."""
    replaced: dict[int, nn.Parameter] = {}  # id(meta parameter) -> its allocated replacement
    for module in model.modules():
        keep = getattr(module, "keep_dtype", ())
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                serving = param.dtype if name in keep else _serving_dtype(param, dtype)
                storage = torch.empty(param.shape, dtype=serving, device=device)
                replaced[id(param)] = nn.Parameter(storage, requires_grad=param.requires_grad)
            module._parameters[name] = replaced[id(param)]


def _cast_buffers(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Move and cast the (recomputed) buffers as `Module.to(device, dtype)` would, except RoPE frequencies
    (`*inv_freq`), which stay float32 as HF's `from_pretrained` keeps them: a bf16 frequency is off by up to 2^-9
    of itself, so the angle at position p by up to p / 512 radians of the fastest pair's (4 at position 2,048)."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                cast = buf.dtype if name.endswith("inv_freq") else _serving_dtype(buf, dtype)
                module._buffers[name] = buf.to(device=device, dtype=cast)


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of `model` still on the meta device (empty once materialised)."""
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.is_meta]


def build_materialised(construct: Callable[[], nn.Module], dtype: torch.dtype, device: torch.device) -> nn.Module:
    """`construct()`'s model with uninitialised weights of `dtype` (floating tensors) on `device`.

    Peak memory is the weights in `dtype` plus one tensor, against 2x for a bf16 model built in float32 and
    cast. Buffers come from the model's `init_buffers()` (run on `device`), then get the same cast as the
    weights, so the result equals `construct()` built on `device` and cast with `.to(dtype)`.
    """
    with torch.device("meta"):  # shapes only: no storage, no init kernels
        model = construct()
    has_buffers = any(True for _ in model.buffers())
    init_buffers = getattr(model, "init_buffers", None)
    if has_buffers and init_buffers is None:
        logger.warning(
            "%s has buffers but no init_buffers(): building it in float32 on %s and casting "
            "(peak memory ~2x the weights)",
            type(model).__name__,
            device,
        )
        with torch.device(device):
            return construct().to(dtype=dtype)
    _allocate_parameters(model, dtype, device)
    if init_buffers is not None:
        with torch.device(device):
            init_buffers()
    left = meta_tensors(model)
    if left:
        raise RuntimeError(f"{type(model).__name__}.init_buffers() left tensors on the meta device: {', '.join(left)}")
    _cast_buffers(model, dtype, device)
    return model
