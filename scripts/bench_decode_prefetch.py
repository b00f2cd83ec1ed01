"""Decode attention with the KV tiles' block ids loaded a tile ahead (`paged_attention(prefetch_ids=True)`)
against today's loop, at "nano"'s decode shapes and a few tile configs (GPU).

Why: compiled for sm_90 (Triton 3.6), today's decode loop looks up a tile's block ids inside the iteration, and
Triton's pipeliner then waits for every copy at the top of each iteration (`async_wait 0`, one K/V buffer):
no tile is in flight while the previous one is folded in. With the ids a tile ahead and 3+ stages it gets 2-3
buffers and waits for all but the newest tile (`async_wait 2` / `4`), as the prefill kernel's sweep found.
Short rows (nano: 600-1,900 keys) stream at ~3.8-3.9 TB/s against 4.3 for long rows; this measures whether
that pipelining closes the gap. Times are CUDA-graph replays (L2 flushed, median), TB/s of K and V read; every
variant is first compared with today's result (max |diff|).

    PYTHONPATH=$PWD python3 scripts/bench_decode_prefetch.py OUT_DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_attention import HEAD_DIM, NANO_SWEEP_SHAPES, NUM_KV_HEADS, _make_batch, _time_graph_ms  # noqa: E402

CONFIGS = ((128, 4, 2), (128, 4, 3), (64, 2, 3), (64, 4, 3), (64, 4, 4), (32, 2, 4), (32, 4, 5))


def sweep() -> list[dict]:
    from framework.attention.triton_paged_attention import AttentionTiles, num_kv_splits, num_sms, paged_attention

    scale = HEAD_DIM ** -0.5
    out = []
    for batch, seq_len in NANO_SWEEP_SHAPES:
        query, cache, meta = _make_batch([1] * batch, [seq_len] * batch, torch.bfloat16, "cuda")
        kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
        ref = paged_attention(query, cache, meta, scale).float()
        for (block_n, warps, stages), ahead in itertools.product(CONFIGS, (False, True)):
            tiles = AttentionTiles(16, block_n, warps, stages)
            splits = num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms(query.device), block_n)
            fn = lambda: paged_attention(query, cache, meta, scale, num_splits=splits, small_tiles=tiles,  # noqa: E731
                                         prefetch_ids=ahead)
            diff = float((fn().float() - ref).abs().max())
            ms = _time_graph_ms(fn)
            r = dict(batch=batch, seq_len=seq_len, block_n=block_n, warps=warps, stages=stages, splits=splits,
                     prefetch_ids=ahead, us=ms * 1e3, tbps=kv_bytes / (ms * 1e-3) / 1e12, max_diff=diff)
            out.append(r)
            print(f"B={batch:>3} S={seq_len:>4} n={block_n:>3} w={warps} st={stages} splits={splits:>2} "
                  f"ids ahead={'yes' if ahead else 'no ':3}: {r['us']:8.1f} us {r['tbps']:5.2f} TB/s "
                  f"max|diff| {diff:.1e}", flush=True)
        del query, cache, meta, ref
        torch.cuda.empty_cache()
    return out


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys((r["batch"], r["seq_len"]) for r in results))
    fig, ax = plt.subplots(figsize=(11, 5))
    for ahead, marker in ((False, "o"), (True, "^")):
        best = [max(r["tbps"] for r in results if (r["batch"], r["seq_len"]) == s and r["prefetch_ids"] == ahead)
                for s in shapes]
        ax.plot(range(len(shapes)), best, marker=marker, label=f"best tiles, ids ahead={ahead}")
    ax.set_xticks(range(len(shapes)), [f"{b}x{s}" for b, s in shapes])
    ax.set(xlabel="decode batch x context", ylabel="TB/s of K and V", title="Decode attention, block ids ahead")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode_prefetch needs a CUDA GPU", file=sys.stderr)
        return 2
    args.out_dir.mkdir(parents=True, exist_ok=True)
    results = sweep()
    (args.out_dir / "decode_prefetch.json").write_text(json.dumps(results, indent=1))
    _plot(results, args.out_dir / "decode_prefetch.png")
    print("\n| batch x context | best today (tiles) | best ids ahead (tiles) |\n|---|---|---|")
    for batch, seq_len in dict.fromkeys((r["batch"], r["seq_len"]) for r in results):
        rows = [r for r in results if (r["batch"], r["seq_len"]) == (batch, seq_len)]
        cells = []
        for ahead in (False, True):
            b = max((r for r in rows if r["prefetch_ids"] == ahead), key=lambda r: r["tbps"])
            cells.append(f"{b['tbps']:.2f} TB/s ({b['block_n']}/{b['warps']}/{b['stages']})")
        print(f"| {batch} x {seq_len} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
