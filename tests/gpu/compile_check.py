"""Compile every Triton kernel that a pytest run launches for an sm_90 (H100/H200) target, on a machine without
a GPU: a stand-in driver reports a CUDA target, the real NVIDIA backend compiles (Triton IR -> PTX -> cubin with
the bundled ptxas), and launches do nothing. Catches what the interpreter accepts but the compiler refuses
(type changes across branches, unsupported ops) before GPU time is spent. Results of the tests are meaningless
(kernels do not run), only compile errors count.

    python3 tests/gpu/compile_check.py tests/samplers/test_sampler_fused.py [more pytest args]
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # conftest only sets it when unset

import pytest  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

ERRORS: list[str] = []


class _Utils:
    def load_binary(self, *args, **kwargs):  # (module, function, n_regs, n_spills, n_max_threads)
        return 0, 0, 0, 0, 1024

    def get_device_properties(self, device):
        return {
            "max_shared_mem": 232448,
            "multiprocessor_count": 132,
            "max_num_regs": 65536,
            "warpSize": 32,
            "sm_clock_rate": 1980000,
            "mem_clock_rate": 2619000,
            "mem_bus_width": 6144,
        }


class _FakeCudaDriver:
    def __init__(self) -> None:
        self.utils = _Utils()
        self.launcher_cls = lambda src, metadata: lambda *args, **kwargs: None

    def is_active(self) -> bool:
        return True

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_device_interface(self):
        import torch

        return torch.cuda

    def get_benchmarker(self):
        return lambda *a, **k: [0.0]

    def get_empty_cache_for_benchmark(self):
        import torch

        return torch.empty(1)

    def clear_cache(self, cache) -> None:
        pass

    def map_python_to_cpp_type(self, ty: str) -> str:
        return ty


driver.set_active(_FakeCudaDriver())

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
