"""Whether Triton can run on the configured CUDA device (V2's GPU path needs it; V1 uses it when it can)."""

from __future__ import annotations

from typing import Optional

import torch

TRITON_MIN_CUDA_CAPABILITY = (7, 0)  # the oldest GPUs Triton compiles for (torch's own Triton check uses it)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _triton_import_error() -> Optional[str]:
    """Why `import triton` fails here, or None when it works."""
    try:
        import triton  # noqa: F401
    except Exception as err:  # an ImportError, or a broken install failing at import time
        return f"{type(err).__name__}: {err}"
    return None


def _cuda_device_capability() -> tuple[str, tuple[int, int]]:
    """Name and compute capability of the CUDA device the engine would use."""
    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def triton_reasons(device: str) -> list[str]:
    """Why Triton cannot run on the configured device (empty when it can, and always on the CPU): V2's GPU path
    needs it, and V1 uses it when it runs (fused sampler, CUDA graphs over Triton attention)."""
    if device == "cpu" or not _cuda_available():
        return []  # device=cuda without a GPU is refused later, with its own message
    error = _triton_import_error()
    if error is not None:
        return [f"the V2 runner needs Triton on CUDA devices, but 'import triton' fails ({error})"]
    name, capability = _cuda_device_capability()
    if capability < TRITON_MIN_CUDA_CAPABILITY:
        need = ".".join(map(str, TRITON_MIN_CUDA_CAPABILITY))
        return [
            f"the V2 runner needs Triton on CUDA devices, and Triton does not support {name} "
            f"(compute capability {capability[0]}.{capability[1]}, Triton needs {need} or newer)"
        ]
    return []
