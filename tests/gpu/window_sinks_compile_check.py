"""Compile the sliding-window and sink variants of the paged-attention kernels for sm_90 without a GPU.

Uses `compile_check.py`'s stand-in driver (real NVIDIA backend, launches do nothing): decode (unsplit, split with
the fused merge, split with the second-launch merge), the prefill kernel (default variant, `qk_ahead`, no page
prefetch) and the older large-row launch, each with a window and sinks, at the gpt-oss-20b head geometry (64 query
heads, 8 KV heads, head_dim 64) and the Gemma 3 one (head_dim 256), bfloat16. Prints one line per compiled kernel
variant and exits non-zero on the first compile error.

    python3 tests/gpu/window_sinks_compile_check.py
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
runpy.run_path(str(REPO / "tests" / "gpu" / "compile_check.py"), run_name="compile_check")  # the fake driver

import torch  # noqa: E402

from framework.layers.attention.metadata import AttentionMetadata  # noqa: E402
from framework.layers.attention.triton_paged_attention import (  # noqa: E402
    _paged_attention_kernel,
    _split_kv_reduce_kernel,
    paged_attention,
)
from framework.layers.attention.triton_prefill_attention import (  # noqa: E402
    PrefillVariant,
    _prefill_attention_kernel,
    default_variant,
)


def _meta(query_lens: list[int], seq_len: int, block_size: int) -> AttentionMetadata:
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    rows = len(query_lens)
    return AttentionMetadata(
        num_tokens=qsl[-1],
        num_rows=rows,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.full((rows,), seq_len, dtype=torch.int32),
        block_tables=torch.zeros((rows, seq_len // block_size + 1), dtype=torch.int32),
        kv_slot_mapping=torch.zeros(qsl[-1], dtype=torch.int64),
        block_size=block_size,
        max_query_len=max(query_lens),
        max_seq_len=seq_len,
    )


def main() -> int:
    for heads, kv_heads, head_dim, window in ((64, 8, 64, 128), (8, 4, 256, 1024)):
        cache = torch.zeros((2, 64, 16, kv_heads, head_dim), dtype=torch.bfloat16)
        sinks = torch.zeros(heads, dtype=torch.float32)
        on_gpu_variant = default_variant(head_dim, on_gpu=True)
        for query_lens, kwargs in (
            ([1] * 4, dict(num_splits=1)),
            ([1] * 4, dict(num_splits=4)),
            ([1] * 4, dict(num_splits=4, fused_reduce=False)),
            ([300, 1], dict(prefill_variant=on_gpu_variant)),
            ([300], dict(prefill_variant=PrefillVariant.parse("qk_ahead=1,prefetch_pages=0", on_gpu_variant))),
            ([300], dict(prefill_kernel=False)),
        ):
            meta = _meta(query_lens, 1000, 16)
            query = torch.zeros((meta.num_tokens, heads, head_dim), dtype=torch.bfloat16)
            paged_attention(query, cache, meta, 0.125, window=window, sinks=sinks, **kwargs)  # type: ignore[arg-type]
    for name, kernel in (
        ("paged_attention", _paged_attention_kernel),
        ("split_kv_reduce", _split_kv_reduce_kernel),
        ("prefill_attention", _prefill_attention_kernel),
    ):
        for key in kernel.device_caches[0][0]:
            print(f"compiled {name}: {key[:160]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
