"""Decode at nano's batches of mixed lengths: the launch order of the programs (`--row-order`) and the decode tiles
as nano's batch drains (`--sweep-mixed`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, mixed_decode_batch, zero_counters
from .plots import rows_plot
from .timing import time_graph_ms

# Decode batches of mixed lengths as nano's decode steps hold them (rows, shortest and longest KV length), and
# one of equal lengths (no order can help it).
ROW_ORDER_SHAPES = [(256, 700, 700), (256, 150, 1300), (192, 400, 1500), (128, 500, 1700), (64, 700, 2000)]


def compare_row_order(dtype: torch.dtype, out_dir: Path, env: dict) -> None:
    """Unsplit decode at nano's mixed lengths: the default grid (KV heads outermost, rows in batch order)
    against programs row by row (all KV heads of a row together) in batch order and longest rows first; each
    one launch in a CUDA graph, L2 flushed. Also the cost of the order itself (row_order.py, once per step)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from framework.layers.attention.row_order import rows_longest_first
    from framework.layers.attention.triton_paged_attention import paged_attention

    rows_out = []
    print(
        f"{'batch':>5} {'keys':>10} {'default us':>10} {'row-major us':>12} {'longest first us':>16} "
        f"{'gain':>6} {'order us':>10}"
    )
    for batch, lo, hi in ROW_ORDER_SHAPES:
        query, cache, meta, gb = mixed_decode_batch(batch, lo, hi, dtype)
        scale = HEAD_DIM**-0.5
        in_order = torch.arange(batch, dtype=torch.int32, device="cuda")
        longest = rows_longest_first(meta.seq_lens)
        times = {
            name: time_graph_ms(lambda order=order: paged_attention(query, cache, meta, scale, row_order=order))
            for name, order in (("default", None), ("row_major", in_order), ("longest_first", longest))
        }
        sort_us = time_graph_ms(lambda: rows_longest_first(meta.seq_lens)) * 1e3
        r = dict(
            batch=batch,
            min_keys=lo,
            max_keys=hi,
            gbytes=gb,
            order_us=sort_us,
            **{f"{k}_us": v * 1e3 for k, v in times.items()},
            **{f"{k}_tbps": gb / v for k, v in times.items()},
        )
        rows_out.append(r)
        print(
            f"{batch:>5} {f'{lo}-{hi}':>10} {r['default_us']:>10.1f} {r['row_major_us']:>12.1f} "
            f"{r['longest_first_us']:>16.1f} {r['default_us'] / r['longest_first_us']:>6.3f} {sort_us:>10.1f}"
        )
    (out_dir / "attention_row_order.json").write_text(json.dumps(dict(env=env, results=rows_out), indent=1))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['batch']}x{r['min_keys']}-{r['max_keys']}" for r in rows_out]
    for i, name in enumerate(("default", "row_major", "longest_first")):
        ax.bar(
            [j + 0.27 * (i - 1) for j in range(len(rows_out))], [r[f"{name}_tbps"] for r in rows_out], 0.27, label=name
        )
    ax.set_xticks(range(len(rows_out)), labels)
    ax.set(ylabel="KV bytes / time (TB/s)", title="Unsplit decode attention: launch order of the programs")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "attention_row_order.png", dpi=120)
    plt.close(fig)


# "nano"'s decode batches as it drains: B rows left at step s hold the requests with output_len > s, whose
# contexts are input_len + s (input and output lengths uniform in [100, 1024]): batch, min keys, max keys.
MIXED_SHAPES = [
    (192, 430, 1355),
    (160, 500, 1420),
    (128, 660, 1590),
    (96, 780, 1700),
    (64, 890, 1820),
    (48, 950, 1870),
    (32, 1010, 1930),
    (24, 1040, 1960),
    (16, 1070, 1990),
    (8, 1100, 2020),
    (4, 1120, 2040),
]
MIXED_CONFIGS = (None, (64, 2, 3), (64, 2, 2), (128, 4, 2), (64, 4, 2), (64, 4, 3), (32, 4, 3))


def sweep_mixed(
    dtype: torch.dtype, out_dir: Path, env: dict, max_seq_len: int = 2048, num_heads: int = NUM_HEADS
) -> None:
    """Decode tiles at "nano"'s draining batches of mixed lengths, as the engine launches them: rows longest
    first, the split rule at the CUDA graphs' `max_seq_len` (nano's max_model_len); each one launch in a CUDA
    graph, L2 flushed, `num_heads` query heads over 8 KV heads. Prints µs and TB/s per tile config (`rule` =
    `decode_tiles`' choice); writes `attention_mixed.json` and `attention_mixed.png`."""
    import dataclasses

    from framework.layers.attention.launch_config import AttentionTiles, decode_tiles, num_kv_splits, num_sms
    from framework.layers.attention.row_order import rows_longest_first
    from framework.layers.attention.triton_paged_attention import paged_attention

    labels = ["rule" if c is None else "/".join(map(str, c)) for c in MIXED_CONFIGS]
    print(f"{'batch':>5} {'keys':>10} " + " ".join(f"{name:>14}" for name in labels) + "   (us, splits)")
    rows_out = []
    for batch, lo, hi in MIXED_SHAPES:
        query, cache, meta, gb = mixed_decode_batch(batch, lo, hi, dtype, num_heads)
        meta = dataclasses.replace(meta, max_seq_len=max_seq_len)
        scale = HEAD_DIM**-0.5
        order = rows_longest_first(meta.seq_lens)
        counters = zero_counters(batch)
        sms = num_sms(query.device)
        cells = []
        for cfg, label in zip(MIXED_CONFIGS, labels):
            tiles = (
                decode_tiles(
                    HEAD_DIM,
                    num_heads // NUM_KV_HEADS,
                    True,
                    num_programs=batch * NUM_KV_HEADS,
                    max_seq_len=max_seq_len,
                    num_sms=sms,
                )
                if cfg is None
                else AttentionTiles(16, *cfg)
            )
            splits = num_kv_splits(batch, NUM_KV_HEADS, max_seq_len, sms, tiles.block_n)
            us = (
                time_graph_ms(
                    lambda t=tiles: paged_attention(
                        query, cache, meta, scale, small_tiles=t, row_order=order, split_counters=counters
                    )
                )
                * 1e3
            )
            rows_out.append(
                dict(
                    batch=batch,
                    min_keys=lo,
                    max_keys=hi,
                    tiles=label,
                    splits=splits,
                    us=us,
                    tbps=gb / us * 1e3,
                    gbytes=gb,
                )
            )
            cells.append(f"{us:>8.1f} ({splits:>2})")
        print(f"{batch:>5} {f'{lo}-{hi}':>10} " + " ".join(f"{c:>14}" for c in cells), flush=True)
        query = cache = meta = None
        torch.cuda.empty_cache()
    (out_dir / "attention_mixed.json").write_text(json.dumps(dict(env=env, results=rows_out), indent=1))
    series = [
        (
            label,
            [r["batch"] for r in rows_out if r["tiles"] == label],
            [r["tbps"] for r in rows_out if r["tiles"] == label],
        )
        for label in labels
    ]
    rows_plot(
        out_dir / "attention_mixed.png",
        series,
        "decode rows (nano's draining batch)",
        "KV bytes / time (TB/s)",
        "Decode attention tiles at mixed lengths",
    )
