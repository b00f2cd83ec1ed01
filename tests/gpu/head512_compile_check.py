"""Compile the paged-attention kernels for sm_90 at head_dim 512 (Gemma 4's full layers) without a GPU.

Uses `compile_check.py`'s stand-in driver (real NVIDIA backend, launches do nothing), which refuses a kernel that
needs more shared memory than an H100/H200 multiprocessor has (Triton's OutOfResources). Compiles, with the GPU
tiles (`launch_config.WIDE_*_TILES`): decode unsplit, split with the fused merge and with the second-launch merge,
the prefill kernel and the older large-row launch, each plain and with a window and sinks, at Gemma 4 31B's and
26B-A4B's full-layer geometry (32 or 16 query heads over 4 or 2 KV heads), bfloat16 and float32. Prints each
compiled kernel's shared memory and exits non-zero on the first compile error.

    python3 tests/gpu/head512_compile_check.py
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
runpy.run_path(str(REPO / "tests" / "gpu" / "compile_check.py"), run_name="compile_check")  # the fake driver
sys.path.insert(0, str(REPO / "tests" / "gpu"))

import torch  # noqa: E402
from window_sinks_compile_check import _meta  # noqa: E402

from framework.layers.attention.launch_config import decode_tiles, prefill_tiles  # noqa: E402
from framework.layers.attention.triton_paged_attention import (  # noqa: E402
    _paged_attention_kernel,
    _split_kv_reduce_kernel,
    paged_attention,
)
from framework.layers.attention.triton_prefill_attention import (  # noqa: E402
    _prefill_attention_kernel,
    default_variant,
)

SHARED_MEMORY = 232448  # bytes a block may use on sm_90 (227 KB)


def main() -> int:
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv_heads in ((32, 4), (16, 2)):
            cache = torch.zeros((2, 64, 16, kv_heads, 512), dtype=dtype)
            size, group = dtype.itemsize, heads // kv_heads
            # The tensors live on the CPU: the GPU's tiles are asked for (on_gpu=True) rather than the interpreter's.
            tiles = dict(
                small_tiles=decode_tiles(512, group, True, size),
                large_tiles=prefill_tiles(512, group, True, size),
                prefill_variant=default_variant(512, True, size),
            )
            for window, sinks in ((0, None), (1024, torch.zeros(heads, dtype=torch.float32))):
                for query_lens, kwargs in (
                    ([1] * 4, dict(num_splits=1)),
                    ([1] * 4, dict(num_splits=4)),
                    ([1] * 4, dict(num_splits=4, fused_reduce=False)),
                    ([300, 1], dict()),
                    ([300], dict(prefill_kernel=False)),
                ):
                    meta = _meta(query_lens, 1000, 16)
                    query = torch.zeros((meta.num_tokens, heads, 512), dtype=dtype)
                    paged_attention(query, cache, meta, 0.04, window=window, sinks=sinks, **tiles, **kwargs)  # type: ignore[arg-type]
    for name, kernel in (
        ("paged_attention", _paged_attention_kernel),
        ("split_kv_reduce", _split_kv_reduce_kernel),
        ("prefill_attention", _prefill_attention_kernel),
    ):
        for key, compiled in kernel.device_caches[0][0].items():
            shared = compiled.metadata.shared
            assert shared <= SHARED_MEMORY, (name, shared)
            print(f"compiled {name}: {shared} B shared: {str(key)[:120]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
