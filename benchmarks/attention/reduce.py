"""`--compare-reduce`: the split-KV decode with its reduce fused into the attention launch against the two-launch
path, and the shape-dependent decode tiles against the fixed 128/4/2 ones at nano's unsplit shapes."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, make_batch, zero_counters
from .timing import time_graph_ms

REDUCE_BATCHES, REDUCE_SEQ_LENS = (1, 4, 16), (1024, 2048, 4096)


def bench_reduce(batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """Split-KV decode, reduce fused vs a second launch: `NUM_LAYERS` calls in one graph, per call."""
    from framework.layers.attention.triton_paged_attention import decode_tiles, num_kv_splits, num_sms, paged_attention

    query, cache, meta = make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
    scale = HEAD_DIM**-0.5
    tiles = decode_tiles(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, True)
    splits = num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms(query.device), tiles.block_n)
    counters = zero_counters(batch)

    def layers(fused: bool):
        def step() -> None:
            for _ in range(NUM_LAYERS):
                if fused:
                    paged_attention(query, cache, meta, scale, split_counters=counters)
                else:
                    paged_attention(query, cache, meta, scale, fused_reduce=False)

        return step

    fused_us = time_graph_ms(layers(True)) * 1e3 / NUM_LAYERS
    unfused_us = time_graph_ms(layers(False)) * 1e3 / NUM_LAYERS
    ours = paged_attention(query, cache, meta, scale, split_counters=counters).float()
    two_launch = paged_attention(query, cache, meta, scale, fused_reduce=False).float()
    torch.cuda.synchronize()
    result = dict(
        kind="reduce",
        batch=batch,
        seq_len=seq_len,
        num_splits=splits,
        fused_us=fused_us,
        unfused_us=unfused_us,
        saved_us_per_step=(unfused_us - fused_us) * NUM_LAYERS,
        max_abs_diff=float((ours - two_launch).abs().max()),
        counters_zero=not bool(counters.any()),
    )
    query = cache = meta = None
    torch.cuda.empty_cache()
    return result


TILES_SHAPES = ((256, 640), (256, 900), (128, 1200), (64, 1500), (64, 2048), (256, 2048))


def bench_tiles(batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """Unsplit decode at nano's shapes: the shape-dependent `decode_tiles` against the fixed 128/4/2 tiles."""
    from framework.layers.attention.triton_paged_attention import AttentionTiles, decode_tiles, num_sms, paged_attention

    query, cache, meta = make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
    scale = HEAD_DIM**-0.5
    rule = decode_tiles(
        HEAD_DIM,
        NUM_HEADS // NUM_KV_HEADS,
        True,
        num_programs=batch * NUM_KV_HEADS,
        max_seq_len=seq_len,
        num_sms=num_sms(query.device),
    )
    fixed = AttentionTiles(16, 128, 4, 2)
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    result = dict(kind="tiles", batch=batch, seq_len=seq_len, rule=[rule.block_n, rule.num_warps, rule.num_stages])
    for name, tiles in (("rule", rule), ("fixed_128_4_2", fixed)):
        ms = time_graph_ms(lambda: paged_attention(query, cache, meta, scale, small_tiles=tiles))
        result[f"{name}_us"], result[f"{name}_tbps"] = ms * 1e3, kv_bytes / (ms * 1e-3) / 1e12
    query = cache = meta = None
    torch.cuda.empty_cache()
    return result


def compare_reduce(dtype: torch.dtype, out_dir: Path, env: dict) -> list[dict]:
    """The `--compare-reduce` tables (fused vs two-launch reduce; decode tiles rule vs fixed), JSON and plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(
        f"{'batch':>5} {'seq':>5} {'splits':>6} {'fused us':>9} {'2-launch us':>11} {'saved/step us':>13} "
        f"{'max diff':>9} {'counters 0':>10}"
    )
    results = []
    for batch in REDUCE_BATCHES:
        for seq_len in REDUCE_SEQ_LENS:
            r = bench_reduce(batch, seq_len, dtype)
            results.append(r)
            print(
                f"{batch:>5} {seq_len:>5} {r['num_splits']:>6} {r['fused_us']:>9.2f} {r['unfused_us']:>11.2f} "
                f"{r['saved_us_per_step']:>13.1f} {r['max_abs_diff']:>9.2e} {str(r['counters_zero']):>10}",
                flush=True,
            )
    print(f"\n{'batch':>5} {'seq':>5} {'rule tiles':>10} {'rule us':>8} {'TB/s':>5} {'128/4/2 us':>10} {'TB/s':>5}")
    for batch, seq_len in TILES_SHAPES:
        r = bench_tiles(batch, seq_len, dtype)
        results.append(r)
        print(
            f"{batch:>5} {seq_len:>5} {'/'.join(map(str, r['rule'])):>10} {r['rule_us']:>8.1f} "
            f"{r['rule_tbps']:>5.2f} {r['fixed_128_4_2_us']:>10.1f} {r['fixed_128_4_2_tbps']:>5.2f}",
            flush=True,
        )
    (out_dir / "attention_reduce.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for batch in REDUCE_BATCHES:
        rows = [r for r in results if r["kind"] == "reduce" and r["batch"] == batch]
        line = ax.plot(
            [r["seq_len"] for r in rows], [r["fused_us"] for r in rows], marker="o", label=f"fused B={batch}"
        )[0]
        ax.plot(
            [r["seq_len"] for r in rows],
            [r["unfused_us"] for r in rows],
            ls="--",
            marker="x",
            color=line.get_color(),
            label=f"2 launches B={batch}",
        )
    ax.set(
        xscale="log",
        xlabel="keys per row",
        ylabel=f"us per call ({NUM_LAYERS} calls in one graph)",
        title="Split-KV decode: reduce fused vs second launch",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "attention_reduce.png", dpi=120)
    plt.close(fig)
    return results
