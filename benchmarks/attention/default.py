"""The default run of `bench_attention.py`: decode at each batch x sequence length (our kernel with the split rule,
forced to one split, eager, host cost; the dense baseline), then three prefill chunks."""

from __future__ import annotations

import torch

from .cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, dense_kv, make_batch, sdpa_fn, zero_counters
from .timing import host_us, time_graph_ms, time_ms


def bench_decode(batch: int, seq_len: int, dtype: torch.dtype, with_baseline: bool) -> dict:
    from framework.layers.attention.triton_paged_attention import decode_tiles, num_kv_splits, num_sms, paged_attention

    query, cache, meta = make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
    scale = HEAD_DIM**-0.5
    kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    tiles = decode_tiles(HEAD_DIM, NUM_HEADS // NUM_KV_HEADS, True)
    splits = num_kv_splits(batch, NUM_KV_HEADS, seq_len, num_sms(query.device), tiles.block_n)
    result = dict(kind="decode", batch=batch, seq_len=seq_len, kv_bytes=kv_bytes, num_splits=splits)
    counters = zero_counters(batch)
    attend = lambda: paged_attention(query, cache, meta, scale, split_counters=counters)  # noqa: E731
    result["triton_ms"] = time_graph_ms(attend)
    result["triton_1split_ms"] = time_graph_ms(lambda: paged_attention(query, cache, meta, scale, num_splits=1))
    result["triton_eager_ms"] = time_ms(attend)
    result["triton_host_us"] = host_us(attend)
    if with_baseline:
        k, v = dense_kv(cache, meta, seq_len)
        q = query.view(batch, NUM_HEADS, 1, HEAD_DIM)
        fn, name = sdpa_fn(q, k, v, causal=False)
        result["baseline"] = name
        result["baseline_ms"] = time_graph_ms(fn)
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
    query, cache, meta = make_batch([chunk], [seq_len], dtype, "cuda")
    scale = HEAD_DIM**-0.5
    pairs = sum(context_len + i + 1 for i in range(chunk))  # visible (query, key) pairs, causal
    flops = 4 * NUM_HEADS * HEAD_DIM * pairs
    result = dict(kind="prefill", batch=1, context_len=context_len, chunk=chunk, flops=flops)
    result["triton_ms"] = time_graph_ms(lambda: paged_attention(query, cache, meta, scale))
    result["triton_tflops"] = flops / (result["triton_ms"] * 1e-3) / 1e12
    if context_len == 0:  # the dense causal mask of SDPA matches only a prefill without cached prefix
        k, v = dense_kv(cache, meta, seq_len)
        q = query.view(1, chunk, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        fn, name = sdpa_fn(q, k, v, causal=True)
        result["baseline"] = name
        result["baseline_ms"] = time_graph_ms(fn)
        result["baseline_tflops"] = flops / (result["baseline_ms"] * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return result


PREFILL_CASES = ((0, 2048), (2048, 2048), (0, 8192))  # (cached context, chunk)


def decode_and_prefill(dtype: torch.dtype, batches: list[int], seq_lens: list[int], with_baseline: bool) -> list[dict]:
    """The default tables, printed as they fill: decode rows (`bench_decode`), then prefill (`bench_prefill`)."""
    results = []
    header = (
        f"{'batch':>5} {'seq':>5} {'splits':>6} {'triton us':>10} {'TB/s':>6} {'1split us':>10} "
        f"{'TB/s':>6} {'eager us':>9} {'host us':>8} {'baseline us':>11} {'TB/s':>6}"
    )
    print(header)
    for seq_len in seq_lens:
        for batch in batches:
            r = bench_decode(batch, seq_len, dtype, with_baseline=with_baseline)
            results.append(r)
            base = f"{r['baseline_ms'] * 1e3:>11.1f} {r['baseline_tbps']:>6.2f}" if "baseline_ms" in r else ""
            print(
                f"{batch:>5} {seq_len:>5} {r['num_splits']:>6} {r['triton_ms'] * 1e3:>10.1f} "
                f"{r['triton_tbps']:>6.2f} {r['triton_1split_ms'] * 1e3:>10.1f} {r['triton_1split_tbps']:>6.2f} "
                f"{r['triton_eager_ms'] * 1e3:>9.1f} {r['triton_host_us']:>8.1f} {base}",
                flush=True,
            )
    print(f"\n{'context':>7} {'chunk':>5} {'triton us':>10} {'TFLOP/s':>8} {'baseline us':>11} {'TFLOP/s':>8}")
    for context_len, chunk in PREFILL_CASES:
        r = bench_prefill(context_len, chunk, dtype)
        results.append(r)
        base = f"{r['baseline_ms'] * 1e3:>11.1f} {r['baseline_tflops']:>8.1f}" if "baseline_ms" in r else ""
        print(
            f"{context_len:>7} {chunk:>5} {r['triton_ms'] * 1e3:>10.1f} {r['triton_tflops']:>8.1f} {base}", flush=True
        )
    return results
