"""Benchmark the Triton paged attention on a CUDA GPU: decode time and achieved KV bandwidth, plus prefill.

Geometry of Qwen3-0.6B (16 query heads, 8 KV heads, head_dim 128, bfloat16, KV blocks of 16 tokens in
shuffled physical order). For each decode batch x sequence length it times, with `triton.testing.do_bench`
(median, L2 flushed between runs):

* `triton`: `paged_attention` as the engine calls it (split-KV rule on),
* `triton_1split`: the same kernel forced to one split (what the rule saves),
* `sdpa`: `torch.nn.functional.scaled_dot_product_attention` on the same keys laid out densely
  (`[B, heads, S, D]`, GQA native when the installed torch supports it), or flash-attn if importable.

`--compare-reduce` times instead the split-KV decode with its reduce fused into the attention launch (the
default) against the two-launch path (`fused_reduce=False`) at batch 1/4/16 x 1024..4096 keys: 28
back-to-back calls (one per layer of a Qwen3-0.6B step) in one CUDA graph, per call and saved per step;
then the shape-dependent decode tiles against the fixed 128/4/2 ones at nano's unsplit shapes; writes
`attention_reduce.json` and `attention_reduce.png`.

Achieved bandwidth = bytes of K and V that must be read (2 x sum(seq_lens) x kv_heads x head_dim x 2 B) /
time. Prefill cases report TFLOP/s (4 x heads x head_dim x visible query-key pairs / time).
Prints a table; writes `attention_bench.json` and `attention_bench.png` into the directory given.

    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR [--batches 1 16 64 256 512]
        [--seq-lens 512 1024 2048 4096]
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --compare-reduce
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --sweep-mixed   # tiles at nano's draining batches
    PYTHONPATH=$PWD python benchmarks/bench_attention.py OUT_DIR --sweep-kv-dtype   # bf16 vs FP8 caches
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16
NUM_LAYERS = 28  # Qwen3-0.6B: attention launches per decode step


def _make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    num_heads: int = NUM_HEADS,
):
    """Paged cache holding every row's keys (blocks shuffled), the step's queries and metadata."""
    from framework.layers.attention.metadata import AttentionMetadata

    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_row = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    max_blocks = max(blocks_per_row)
    num_blocks = sum(blocks_per_row)
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32, device=device)
    used = 0
    for row, n in enumerate(blocks_per_row):
        table[row, :n] = perm[used : used + n]
        used += n
    cache = torch.randn(
        (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), generator=gen, device=device, dtype=torch.float32
    ).to(dtype)
    num_tokens = sum(query_lens)
    query = torch.randn((num_tokens, num_heads, HEAD_DIM), generator=gen, device=device).to(dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        num_tokens=num_tokens,
        num_rows=len(seq_lens),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table,
        kv_slot_mapping=torch.zeros(num_tokens, dtype=torch.long, device=device),
        block_size=BLOCK_SIZE,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return query, cache, meta


def _dense_kv(cache: torch.Tensor, meta, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, kv_heads, seq_len, D] K and V of equal-length rows, gathered out of the paged cache."""
    pos = torch.arange(seq_len, device=cache.device)
    slots = meta.block_tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE  # [B, S]
    k = cache[0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    v = cache[1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    return k, v


def _sdpa_fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """A callable running the dense baseline, and its name. q [B, H, Q, D], k/v [B, kvH, S, D]."""
    import torch.nn.functional as F

    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]

        qf, kf, vf = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        return (lambda: flash_attn_func(qf, kf, vf, causal=causal)), "flash_attn"
    except Exception:  # noqa: BLE001 - not installed, or no build for this GPU
        pass
    try:
        F.scaled_dot_product_attention(q[:1], k[:1], v[:1], is_causal=causal, enable_gqa=True)
        return (lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)), "sdpa"
    except Exception:  # noqa: BLE001 - older torch: expand the KV heads (reads twice the bytes)
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return (lambda: F.scaled_dot_product_attention(q, ke, ve, is_causal=causal)), "sdpa_expanded_kv"


def _zero_counters(batch: int) -> torch.Tensor:
    """The split-KV counters a model keeps (framework/layers/attention/backend.py `SplitCounters`): zero, reused."""
    return torch.zeros(batch * NUM_KV_HEADS, dtype=torch.int32, device="cuda")


def _time_ms(fn) -> float:
    """Median time of eager calls (host launch overhead shows when it exceeds the GPU time)."""
    from triton.testing import do_bench

    fn()  # compile outside the timing
    torch.cuda.synchronize()
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _time_graph_ms(fn) -> float:
    """Median GPU time of `fn` replayed from a CUDA graph, as the engine runs decode (no host overhead)."""
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return float(do_bench(graph.replay, warmup=25, rep=100, return_mode="median"))


def _host_us(fn, calls: int = 200) -> float:
    """Host time per call (launches are asynchronous, so this is the CPU cost of one call)."""
    import time

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def bench_decode(batch: int, seq_len: int, dtype: torch.dtype, with_baseline: bool) -> dict:
    from framework.layers.attention.triton_paged_attention import decode_tiles, num_kv_splits, num_sms, paged_attention

    query, cache, meta = _make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    tiles = decode_tiles(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, True)
    splits = num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms(query.device), tiles.block_n)
    result = dict(kind="decode", batch=batch, seq_len=seq_len, kv_bytes=kv_bytes, num_splits=splits)
    counters = _zero_counters(batch)
    attend = lambda: paged_attention(query, cache, meta, scale, split_counters=counters)  # noqa: E731
    result["triton_ms"] = _time_graph_ms(attend)
    result["triton_1split_ms"] = _time_graph_ms(lambda: paged_attention(query, cache, meta, scale, num_splits=1))
    result["triton_eager_ms"] = _time_ms(attend)
    result["triton_host_us"] = _host_us(attend)
    if with_baseline:
        k, v = _dense_kv(cache, meta, seq_len)
        q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
        fn, name = _sdpa_fn(q, k, v, causal=False)
        result["baseline"] = name
        result["baseline_ms"] = _time_graph_ms(fn)
        # Same answer as the dense baseline (a decode query sees every key).
        ours = paged_attention(query, cache, meta, scale).float()
        ref = fn().reshape(batch, NUM_HEADS, HEAD_DIM).float()  # [B, H, 1, D] or flash-attn's [B, 1, H, D]
        result["max_abs_diff_vs_baseline"] = float((ours - ref).abs().max())
        del k, v
    for key in ("triton", "triton_1split", "baseline"):
        if f"{key}_ms" in result:
            result[f"{key}_tbps"] = kv_bytes / (result[f"{key}_ms"] * 1e-3) / 1e12
    query = cache = meta = None  # frees the GPU memory (rebound, not deleted: the lambdas above read these names)
    torch.cuda.empty_cache()
    return result


def bench_prefill(context_len: int, chunk: int, dtype: torch.dtype) -> dict:
    from framework.layers.attention.triton_paged_attention import paged_attention

    seq_len = context_len + chunk
    query, cache, meta = _make_batch([chunk], [seq_len], dtype, "cuda")
    scale = HEAD_DIM**-0.5
    pairs = sum(context_len + i + 1 for i in range(chunk))  # visible (query, key) pairs, causal
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    result = dict(kind="prefill", batch=1, context_len=context_len, chunk=chunk, flops=flops)
    result["triton_ms"] = _time_graph_ms(lambda: paged_attention(query, cache, meta, scale))
    result["triton_tflops"] = flops / (result["triton_ms"] * 1e-3) / 1e12
    if context_len == 0:  # the dense causal mask of SDPA matches only a prefill without cached prefix
        k, v = _dense_kv(cache, meta, seq_len)
        q = query.view(1, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        fn, name = _sdpa_fn(q, k, v, causal=True)
        result["baseline"] = name
        result["baseline_ms"] = _time_graph_ms(fn)
        result["baseline_tflops"] = flops / (result["baseline_ms"] * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return result


DECODE_SWEEP_SHAPES = ((1, 4096), (16, 4096), (64, 4096), (64, 1024), (256, 4096), (16, 1024))
DECODE_SWEEP_CONFIGS = ((32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (64, 8, 3))
# Shapes of "nano"'s decode (contexts ~500-1,900, batch falling from 256 to 1) and tiles whose shared memory
# lets two programs share a multiprocessor (a short row's prologue then hides behind another's stream).
NANO_SWEEP_SHAPES = ((256, 640), (256, 900), (128, 1200), (64, 1500), (16, 1800), (4, 1900), (1, 1900))
NANO_SWEEP_CONFIGS = (
    (128, 4, 2),
    (64, 4, 2),
    (64, 4, 3),
    (32, 4, 3),
    (32, 4, 4),
    (64, 2, 3),
    (32, 2, 4),
    (64, 8, 3),
    (128, 8, 2),
)
# Batch-1..8 decode at "nano"'s contexts (the b1 workload's rows grow from 964 to 1,895 keys): here a batch fills
# few programs, so the split count and the keys a split reads decide the time (the sweeps above stopped at
# splits x 128 <= keys, i.e. 8 splits at 1,900 keys).
SMALL_SWEEP_SHAPES = ((1, 1000), (1, 1400), (1, 1900), (2, 1400), (4, 1900), (8, 1500))
SMALL_SWEEP_CONFIGS = ((128, 4, 2), (64, 4, 2), (64, 2, 3), (32, 4, 3), (32, 2, 4))
SMALL_SWEEP_SPLITS = (1, 2, 4, 6, 8, 12, 16, 24, 32)


def sweep(
    dtype: torch.dtype,
    decode_shapes=DECODE_SWEEP_SHAPES,
    decode_configs=DECODE_SWEEP_CONFIGS,
    with_prefill: bool = True,
    split_counts=(1, 2, 4, 8, 16, 32),
    min_split_keys: int = 128,
) -> list[dict]:
    """Tile configs x split counts at a few decode shapes and tile configs for prefill (graph-timed).

    For choosing the fixed configs in triton_paged_attention.py; not part of the default run.
    """
    from framework.layers.attention.triton_paged_attention import AttentionTiles, paged_attention
    from framework.layers.attention.triton_store_kv import store_kv

    scale = HEAD_DIM**-0.5
    out = []
    for batch, seq_len in decode_shapes:
        query, cache, meta = _make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
        kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
        counters = _zero_counters(batch)
        for block_n, warps, stages in decode_configs:
            tiles = AttentionTiles(16, block_n, warps, stages)
            for splits in split_counts:
                if splits * min_split_keys > seq_len or batch * NUM_KV_HEADS * splits > 8 * 132 * 4:
                    continue
                ms = _time_graph_ms(
                    lambda: paged_attention(
                        query, cache, meta, scale, num_splits=splits, small_tiles=tiles, split_counters=counters
                    )
                )
                r = dict(
                    kind="sweep_decode",
                    batch=batch,
                    seq_len=seq_len,
                    block_n=block_n,
                    warps=warps,
                    stages=stages,
                    splits=splits,
                    us=ms * 1e3,
                    tbps=kv_bytes / (ms * 1e-3) / 1e12,
                )
                out.append(r)
                print(
                    f"decode B={batch:>3} S={seq_len:>4} n={block_n:>3} w={warps} st={stages} "
                    f"splits={splits:>2}: {r['us']:8.1f} us {r['tbps']:5.2f} TB/s",
                    flush=True,
                )
        if batch == 1:
            key = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
            slots = torch.zeros(1, dtype=torch.long, device="cuda")
            for name, fn in (
                ("paged_attention", lambda: paged_attention(query, cache, meta, scale)),
                ("paged_attention_1split", lambda: paged_attention(query, cache, meta, scale, num_splits=1)),
                ("store_kv", lambda: store_kv(key, key, cache, slots)),
                ("torch.empty", lambda: torch.empty(16, 16, device="cuda")),
            ):
                print(f"host {name}: {_host_us(fn):.1f} us/call", flush=True)
                out.append(dict(kind="host", name=name, us=_host_us(fn)))
        query = cache = meta = None
        torch.cuda.empty_cache()
    if not with_prefill:
        return out
    prefill_configs = [
        (128, 64, 8, 3),
        (128, 64, 8, 2),
        (128, 128, 8, 2),
        (128, 128, 8, 3),
        (128, 64, 4, 3),
        (64, 64, 4, 3),
        (128, 32, 8, 4),
    ]
    for context_len, chunk in ((0, 2048), (2048, 2048), (0, 8192)):
        query, cache, meta = _make_batch([chunk], [context_len + chunk], dtype, "cuda")
        flops = 4 * NUM_HEADS * HEAD_DIM * sum(context_len + i + 1 for i in range(chunk))
        for block_m, block_n, warps, stages in prefill_configs:
            tiles = AttentionTiles(block_m, block_n, warps, stages)
            try:
                ms = _time_graph_ms(lambda: paged_attention(query, cache, meta, scale, large_tiles=tiles))
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory
                print(f"prefill {block_m}x{block_n} w={warps} st={stages}: failed {type(err).__name__}")
                continue
            r = dict(
                kind="sweep_prefill",
                context_len=context_len,
                chunk=chunk,
                block_m=block_m,
                block_n=block_n,
                warps=warps,
                stages=stages,
                us=ms * 1e3,
                tflops=flops / (ms * 1e-3) / 1e12,
            )
            out.append(r)
            print(
                f"prefill ctx={context_len:>4} chunk={chunk:>4} {block_m}x{block_n} w={warps} st={stages}: "
                f"{r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s",
                flush=True,
            )
        query = cache = meta = None
        torch.cuda.empty_cache()
    return out


REDUCE_BATCHES, REDUCE_SEQ_LENS = (1, 4, 16), (1024, 2048, 4096)


def bench_reduce(batch: int, seq_len: int, dtype: torch.dtype) -> dict:
    """Split-KV decode, reduce fused vs a second launch: `NUM_LAYERS` calls in one graph, per call."""
    from framework.layers.attention.triton_paged_attention import decode_tiles, num_kv_splits, num_sms, paged_attention

    query, cache, meta = _make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
    scale = HEAD_DIM**-0.5
    tiles = decode_tiles(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, True)
    splits = num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms(query.device), tiles.block_n)
    counters = _zero_counters(batch)

    def layers(fused: bool):
        def step() -> None:
            for _ in range(NUM_LAYERS):
                if fused:
                    paged_attention(query, cache, meta, scale, split_counters=counters)
                else:
                    paged_attention(query, cache, meta, scale, fused_reduce=False)

        return step

    fused_us = _time_graph_ms(layers(True)) * 1e3 / NUM_LAYERS
    unfused_us = _time_graph_ms(layers(False)) * 1e3 / NUM_LAYERS
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

    query, cache, meta = _make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
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
        ms = _time_graph_ms(lambda: paged_attention(query, cache, meta, scale, small_tiles=tiles))
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


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = [r for r in results if r["kind"] == "decode"]
    seq_lens = sorted({r["seq_len"] for r in decode})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for seq_len in seq_lens:
        rows = sorted((r for r in decode if r["seq_len"] == seq_len), key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        line = axes[0].plot(batches, [r["triton_tbps"] for r in rows], marker="o", label=f"triton S={seq_len}")[0]
        if all("baseline_tbps" in r for r in rows):
            axes[0].plot(
                batches,
                [r["baseline_tbps"] for r in rows],
                ls="--",
                color=line.get_color(),
                label=f"{rows[0]['baseline']} S={seq_len}",
            )
        axes[1].plot(
            batches,
            [r["triton_ms"] * 1e3 for r in rows],
            marker="o",
            color=line.get_color(),
            label=f"triton S={seq_len}",
        )
        axes[1].plot(
            batches,
            [r["triton_1split_ms"] * 1e3 for r in rows],
            ls=":",
            color=line.get_color(),
            label=f"1 split S={seq_len}",
        )
    axes[0].set(
        xscale="log",
        xlabel="batch (decode rows)",
        ylabel="achieved KV bandwidth (TB/s)",
        title="Decode attention bandwidth",
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="batch (decode rows)",
        ylabel="time (us)",
        title="Decode attention time (split rule vs 1 split)",
    )
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# Decode batches of mixed lengths as nano's decode steps hold them (rows, shortest and longest KV length), and
# one of equal lengths (no order can help it).
ROW_ORDER_SHAPES = [(256, 700, 700), (256, 150, 1300), (192, 400, 1500), (128, 500, 1700), (64, 700, 2000)]


def _mixed_decode_batch(batch: int, lo: int, hi: int, dtype: torch.dtype, num_heads: int = NUM_HEADS):
    """(query, cache, meta, GB of KV the launch must read): `batch` decode rows of lengths uniform in [lo, hi],
    the same lengths for a given batch size in every mode (seeded by it)."""
    import random

    rng = random.Random(batch)
    lens = [rng.randint(lo, hi) for _ in range(batch)]
    query, cache, meta = _make_batch([1] * batch, lens, dtype, "cuda", num_heads=num_heads)
    return query, cache, meta, 2 * sum(lens) * NUM_KV_HEADS * HEAD_DIM * cache.element_size() / 1e9


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
        query, cache, meta, gb = _mixed_decode_batch(batch, lo, hi, dtype)
        scale = HEAD_DIM**-0.5
        in_order = torch.arange(batch, dtype=torch.int32, device="cuda")
        longest = rows_longest_first(meta.seq_lens)
        times = {
            name: _time_graph_ms(lambda order=order: paged_attention(query, cache, meta, scale, row_order=order))
            for name, order in (("default", None), ("row_major", in_order), ("longest_first", longest))
        }
        sort_us = _time_graph_ms(lambda: rows_longest_first(meta.seq_lens)) * 1e3
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
        query, cache, meta, gb = _mixed_decode_batch(batch, lo, hi, dtype, num_heads)
        meta = dataclasses.replace(meta, max_seq_len=max_seq_len)
        scale = HEAD_DIM**-0.5
        order = rows_longest_first(meta.seq_lens)
        counters = _zero_counters(batch)
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
                _time_graph_ms(
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
    _rows_plot(
        out_dir / "attention_mixed.png",
        series,
        "decode rows (nano's draining batch)",
        "KV bytes / time (TB/s)",
        "Decode attention tiles at mixed lengths",
    )


def _rows_plot(
    path: Path, series: list[tuple[str, list[int], list[float]]], xlabel: str, ylabel: str, title: str
) -> None:
    """One line per (label, decode rows, values), rows on a log axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.8))
    for label, xs, ys in series:
        ax.plot(xs, ys, marker="o", label=label)
    ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
        query, cache16, meta, gb = _mixed_decode_batch(batch, lo, hi, torch.bfloat16)
        meta = dataclasses.replace(meta, max_seq_len=max_seq_len)
        order = rows_longest_first(meta.seq_lens) if batch >= 64 else None
        counters = _zero_counters(batch)
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
                    _time_graph_ms(
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
    _rows_plot(
        out_dir / "attention_kv_dtype.png",
        series,
        "decode rows",
        "speed vs bf16 cache (best tiles each)",
        "Decode attention over FP8 KV caches",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 512])
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    parser.add_argument("--no-baseline", action="store_true", help="skip the dense SDPA/flash-attn baseline")
    parser.add_argument("--sweep", action="store_true", help="also sweep tile configs and split counts")
    parser.add_argument(
        "--sweep-nano",
        action="store_true",
        help="sweep decode tiles at nano's shapes only (no prefill sweep, no default table)",
    )
    parser.add_argument(
        "--sweep-small",
        action="store_true",
        help="sweep tiles x split counts (up to 32, splits of >= 32 keys) at batch 1-8 decode shapes",
    )
    parser.add_argument(
        "--row-order", action="store_true", help="only compare launch orders of unsplit decode at nano's mixed lengths"
    )
    parser.add_argument(
        "--compare-reduce",
        action="store_true",
        help="only compare the fused split-KV reduce with the two-launch one (batch 1/4/16)",
    )
    parser.add_argument(
        "--sweep-kv-dtype",
        action="store_true",
        help="decode over bf16 and FP8 caches, products in bf16 or float16, a few tile configs",
    )
    parser.add_argument(
        "--sweep-mixed", action="store_true", help="only sweep decode tiles at nano's draining batches of mixed lengths"
    )
    parser.add_argument(
        "--heads",
        type=int,
        default=NUM_HEADS,
        help="--sweep-mixed: query heads (8 KV heads), 16 for Qwen3-0.6B, 32 for the Qwen3-8B geometry",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    dtype = getattr(torch, args.dtype)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        dtype=args.dtype,
        heads=args.heads,
        kv_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
    )
    print(f"# {env}", file=sys.stderr)

    if args.compare_reduce:
        compare_reduce(dtype, args.out_dir, env)
        return 0
    if args.sweep_kv_dtype:
        sweep_kv_dtype(args.out_dir, env)
        return 0
    if args.sweep_mixed:
        sweep_mixed(dtype, args.out_dir, env, num_heads=args.heads)
        return 0
    if args.row_order:
        compare_row_order(dtype, args.out_dir, env)
        return 0
    if args.sweep_nano:
        results = sweep(dtype, NANO_SWEEP_SHAPES, NANO_SWEEP_CONFIGS, with_prefill=False)
        (args.out_dir / "attention_sweep_nano.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
        return 0
    if args.sweep_small:
        results = sweep(
            dtype,
            SMALL_SWEEP_SHAPES,
            SMALL_SWEEP_CONFIGS,
            with_prefill=False,
            split_counts=SMALL_SWEEP_SPLITS,
            min_split_keys=32,
        )
        (args.out_dir / "attention_sweep_small.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
        return 0
    results = sweep(dtype) if args.sweep else []
    header = (
        f"{'batch':>5} {'seq':>5} {'splits':>6} {'triton us':>10} {'TB/s':>6} {'1split us':>10} "
        f"{'TB/s':>6} {'eager us':>9} {'host us':>8} {'baseline us':>11} {'TB/s':>6}"
    )
    print(header)
    for seq_len in args.seq_lens:
        for batch in args.batches:
            r = bench_decode(batch, seq_len, dtype, with_baseline=not args.no_baseline)
            results.append(r)
            base = f"{r['baseline_ms'] * 1e3:>11.1f} {r['baseline_tbps']:>6.2f}" if "baseline_ms" in r else ""
            print(
                f"{batch:>5} {seq_len:>5} {r['num_splits']:>6} {r['triton_ms'] * 1e3:>10.1f} "
                f"{r['triton_tbps']:>6.2f} {r['triton_1split_ms'] * 1e3:>10.1f} {r['triton_1split_tbps']:>6.2f} "
                f"{r['triton_eager_ms'] * 1e3:>9.1f} {r['triton_host_us']:>8.1f} {base}",
                flush=True,
            )
    print(f"\n{'context':>7} {'chunk':>5} {'triton us':>10} {'TFLOP/s':>8} {'baseline us':>11} {'TFLOP/s':>8}")
    for context_len, chunk in ((0, 2048), (2048, 2048), (0, 8192)):
        r = bench_prefill(context_len, chunk, dtype)
        results.append(r)
        base = f"{r['baseline_ms'] * 1e3:>11.1f} {r['baseline_tflops']:>8.1f}" if "baseline_ms" in r else ""
        print(
            f"{context_len:>7} {chunk:>5} {r['triton_ms'] * 1e3:>10.1f} {r['triton_tflops']:>8.1f} {base}", flush=True
        )

    (args.out_dir / "attention_bench.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
    _plot(results, args.out_dir / "attention_bench.png")
    print(f"# wrote {args.out_dir / 'attention_bench.json'} and attention_bench.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
