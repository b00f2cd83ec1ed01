"""Tile configs x split counts at a few decode shapes, and prefill tile configs (`--sweep`, `--sweep-nano`,
`--sweep-small`): for choosing the fixed configs of the attention launch rules."""

from __future__ import annotations

import torch

from .cases import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, make_batch, zero_counters
from .timing import host_us, time_graph_ms

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
        query, cache, meta = make_batch([1] * batch, [seq_len] * batch, dtype, "cuda")
        kv_bytes = 2 * batch * seq_len * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
        counters = zero_counters(batch)
        for block_n, warps, stages in decode_configs:
            tiles = AttentionTiles(16, block_n, warps, stages)
            for splits in split_counts:
                if splits * min_split_keys > seq_len or batch * NUM_KV_HEADS * splits > 8 * 132 * 4:
                    continue
                ms = time_graph_ms(
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
                print(f"host {name}: {host_us(fn):.1f} us/call", flush=True)
                out.append(dict(kind="host", name=name, us=host_us(fn)))
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
        query, cache, meta = make_batch([chunk], [context_len + chunk], dtype, "cuda")
        flops = 4 * NUM_HEADS * HEAD_DIM * sum(context_len + i + 1 for i in range(chunk))
        for block_m, block_n, warps, stages in prefill_configs:
            tiles = AttentionTiles(block_m, block_n, warps, stages)
            try:
                ms = time_graph_ms(lambda: paged_attention(query, cache, meta, scale, large_tiles=tiles))
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
