"""`--sweep-kv-dtype`: decode attention over a bf16 cache and over FP8 caches, products in bf16 or float16."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, mixed_decode_batch, zero_counters
from .plots import rows_plot
from .timing import time_graph_ms

# FP8 caches: decode batches of nano's shapes (its first steps, draining, batch 1), each cache type with the
# products in the query's bf16 or in float16, over a few tile configs.
KV_DTYPE_SHAPES = [(256, 300, 1100), (128, 660, 1590), (64, 890, 1820), (16, 1070, 1990), (1, 1400, 1400)]
KV_DTYPE_CONFIGS = (None, (64, 2, 3), (64, 4, 2), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 4, 3))
# (label, cache dtype, products in float16)
KV_DTYPE_MODES = (
    ("bf16", None, False),
    ("e4m3", torch.float8_e4m3fn, False),
    ("e4m3-f16", torch.float8_e4m3fn, True),
    ("e5m2", torch.float8_e5m2, False),
    ("e5m2-f16", torch.float8_e5m2, True),
)


def sweep_kv_dtype(out_dir: Path, env: dict, max_seq_len: int = 2048) -> None:
    """Decode attention over a bf16 cache and over FP8 caches (`cache.kv_cache_dtype`), products in bf16 or in
    float16 (`dot_f16`), at `KV_DTYPE_SHAPES` and each tile config of `KV_DTYPE_CONFIGS` (`rule` =
    `decode_tiles`' choice), launched as the engine does (rows longest first, the split rule at max_seq_len);
    each one launch in a CUDA graph, L2 flushed. TB/s counts the bf16 cache's bytes for every mode (so a mode
    twice as fast shows twice the figure). Prints the best config per mode and shape; writes
    `attention_kv_dtype.json` and `.png`."""
    import dataclasses

    from framework.layers.attention.launch_config import AttentionTiles, decode_tiles, num_kv_splits, num_sms
    from framework.layers.attention.row_order import rows_longest_first
    from framework.layers.attention.triton_paged_attention import paged_attention

    labels = ["rule" if c is None else "/".join(map(str, c)) for c in KV_DTYPE_CONFIGS]
    print(f"{'batch':>5} {'keys':>10} {'mode':>14} " + " ".join(f"{name:>8}" for name in labels) + "  (us)")
    rows_out = []
    for batch, lo, hi in KV_DTYPE_SHAPES:
        query, cache16, meta, gb = mixed_decode_batch(batch, lo, hi, torch.bfloat16)
        meta = dataclasses.replace(meta, max_seq_len=max_seq_len)
        order = rows_longest_first(meta.seq_lens) if batch >= 64 else None
        counters = zero_counters(batch)
        sms = num_sms(query.device)
        for mode, cache_dtype, f16 in KV_DTYPE_MODES:
            cache = cache16 if cache_dtype is None else cache16.to(cache_dtype)
            cells = []
            for cfg, label in zip(KV_DTYPE_CONFIGS, labels):
                tiles = (
                    decode_tiles(
                        HEAD_DIM,
                        NUM_HEADS // NUM_KV_HEADS,
                        True,
                        num_programs=batch * NUM_KV_HEADS,
                        max_seq_len=max_seq_len,
                        num_sms=sms,
                    )
                    if cfg is None
                    else AttentionTiles(16, *cfg)
                )
                us = (
                    time_graph_ms(
                        lambda t=tiles: paged_attention(
                            query,
                            cache,
                            meta,
                            HEAD_DIM**-0.5,
                            small_tiles=t,
                            row_order=order,
                            split_counters=counters,
                            dot_f16=f16,
                        )
                    )
                    * 1e3
                )
                splits = num_kv_splits(batch, NUM_KV_HEADS, max_seq_len, sms, tiles.block_n)
                rows_out.append(
                    dict(
                        batch=batch,
                        min_keys=lo,
                        max_keys=hi,
                        mode=mode,
                        tiles=label,
                        splits=splits,
                        us=us,
                        tbps_bf16_bytes=gb / us * 1e3,
                    )
                )
                cells.append(f"{us:>8.1f}")
            print(f"{batch:>5} {f'{lo}-{hi}':>10} {mode:>14} " + " ".join(cells), flush=True)
            cache = None
        query = cache16 = meta = None
        torch.cuda.empty_cache()
    (out_dir / "attention_kv_dtype.json").write_text(json.dumps(dict(env=env, results=rows_out), indent=1))
    batches = [b for b, _, _ in KV_DTYPE_SHAPES]

    def best_us(mode: str, batch: int) -> float:
        return min(r["us"] for r in rows_out if r["mode"] == mode and r["batch"] == batch)

    series = [(mode, batches, [best_us("bf16", b) / best_us(mode, b) for b in batches]) for mode, *_ in KV_DTYPE_MODES]
    rows_plot(
        out_dir / "attention_kv_dtype.png",
        series,
        "decode rows",
        "speed vs bf16 cache (best tiles each)",
        "Decode attention over FP8 KV caches",
    )
