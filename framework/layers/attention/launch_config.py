"""Fixed launch configurations of the paged-attention kernels: tile shapes and the split-KV rule.

Nothing here is measured at run time: the tiles are constants fitted once on an H200 (bf16, Qwen3-0.6B
geometry; `benchmarks/bench_attention.py --sweep` reproduces the sweep), and the number of KV splits for a
decode batch comes from a closed-form cost model (`num_kv_splits`), cached per batch shape.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from framework.layers.kernels.launch_math import cdiv, next_power_of_2

# A KV split reads at least this many keys (one 128-key tile). Was 256 (two tiles) while the merge of the splits
# waited one L2 round trip per split; with the merge unrolled (triton_tiles._merge_kv_splits), one-tile splits
# ran a batch-1 layer ~1.1 us faster at 1,400 keys on an H200 (1e476a2:scripts/bench_pdl.py --ablate, 2026-12-02).
MIN_SPLIT_TOKENS = 128
MERGE_UNROLL = 8  # KV splits the merge of a split launch takes per unrolled step (triton_tiles._merge_kv_splits)
MAX_KV_SPLITS = 32
PROGRAMS_PER_SM = 2  # decode programs per multiprocessor the split rule aims at (fitted on an H200)
SHORT_CONTEXT = 2048  # longest max_seq_len given the shape-dependent decode tiles (nano's max_model_len)
# Programs (rows x KV heads) per multiprocessor from which the shape-dependent decode tiles apply (decode_tiles).
MIN_PROGRAMS_PER_SM_64_2_3 = 7  # 64-key tiles, 2 warps, 3 stages: 128+ rows of 8 KV heads on 132 SMs
MIN_PROGRAMS_PER_SM_64_4_2 = 5  # 64-key tiles, 4 warps, 2 stages: 83-127 rows
# Head dims the Triton attention kernels take: powers of two; 512 is Gemma 4's full layers (`global_head_dim`).
TRITON_HEAD_DIMS = (16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class AttentionTiles:
    """Fixed launch configuration of one launch of `_paged_attention_kernel` (no autotuning)."""

    block_m: int  # matrix rows per query tile (tokens x GQA group), power of two
    block_n: int  # keys per KV tile, power of two
    num_warps: int
    num_stages: int


# 512-wide heads (Gemma 4's full layers), fitted to sm_90's limits by compiling, not measured (no GPU run yet):
# bfloat16, Triton's sm_90 compile and ptxas -v (tests/gpu/head512_compile_check.py). The [BLOCK_M, 512] float32
# accumulator alone is 128 registers a thread for 32 rows on 8 warps, so the large-row tiles halve the rows of
# the 256-wide ones: 32 rows x 32 keys, 8 warps, 2 stages use ~100 KB of shared memory and 174-179 registers,
# no spills (64 rows spilled at 255 registers even on 8 warps). Decode: 32-key tiles, 4 warps, 2 stages use
# ~83 KB and 255 registers (8 bytes spilled), two programs a multiprocessor as the split rule assumes
# (PROGRAMS_PER_SM); 64-key tiles took ~150 KB and spilled 248 bytes. Float32 queries compile with the same
# tiles (~200 KB in prefill, ~166 KB in decode) but spill.
WIDE_PREFILL_TILES = AttentionTiles(32, 32, 8, 2)
WIDE_DECODE_TILES = AttentionTiles(16, 32, 4, 2)  # block_m follows the GQA group


def prefill_tiles(head_dim: int, group: int, on_gpu: bool, elem_size: int = 2) -> AttentionTiles:
    """Large-row tiles: 128 query rows (two Hopper warpgroups of 64 for wgmma), 3-stage KV pipeline.

    Measured on an H200 (bf16, head_dim 128, triton 3.6): 128x128 tiles with 8 warps and 3 stages ran
    fastest of the 128/64 x 128/64/32 configs tried (320 TFLOP/s on a causal 8192-token prefill).
    """
    if not on_gpu:  # interpreter: small tiles so tests cross tile boundaries
        return AttentionTiles(max(32, next_power_of_2(group)), 16, 4, 1)
    if head_dim > 256:  # 512-wide heads: see WIDE_PREFILL_TILES
        tiles = WIDE_PREFILL_TILES
    elif head_dim > 128 or elem_size > 2:  # 256-wide heads or float32: shared memory allows less
        tiles = AttentionTiles(64, 32, 4, 2)
    elif head_dim == 128:
        tiles = AttentionTiles(128, 128, 8, 3)
    else:
        tiles = AttentionTiles(128, 64, 4, 3)
    return AttentionTiles(max(tiles.block_m, next_power_of_2(group)), tiles.block_n, tiles.num_warps, tiles.num_stages)


def decode_tiles(
    head_dim: int,
    group: int,
    on_gpu: bool,
    elem_size: int = 2,
    *,
    num_programs: int = 0,
    max_seq_len: int = 0,
    num_sms: int = 1,
) -> AttentionTiles:
    """Small-row tiles: the GQA group (padded to the 16 rows an MMA needs) and long KV tiles for streaming;
    with `num_programs` (rows x KV heads), `max_seq_len` and `num_sms` given, shorter tiles for full batches
    of short rows.

    Measured on an H200 (bf16, head_dim 128): 128-key tiles, 4 warps, 2 stages beat 32/64-key tiles and
    deeper pipelines at every batch tried (4.1-4.3 TB/s from 64 rows of 4096 keys up). Compiled for sm_90
    the decode loop holds one K/V buffer (docs/kernels.md): ~74 KB of shared memory a program with 128-key
    tiles, ~39 KB with 64-key ones (Triton 3.9's compile), so 64-key programs share a multiprocessor more
    and one's prologue hides behind another's stream. At nano's draining batches of mixed lengths
    (`bench_attention.py --sweep-mixed`, rows longest first, 2026-12-04, the Qwen3-0.6B and the 8B geometry's
    GQA groups alike, µs): from 128 rows up 64-key tiles / 2 warps / 3 stages are the fastest (128 x 660-1,590: 153.8
    against 159.7 for 128/4/2); at 96 rows 64/4/2 (129.5 against 134.5 for 64/2/3); at 48-64 rows 128/4/2
    (64 x 890-1,820: 99.2 against 105.9; 48 rows 86.0 against 89.1); below, where the split rule's latency
    regime starts, 128/4/2 was within 2 % of the best except at 24 rows (left: one point). Hence by programs
    per multiprocessor: >= MIN_PROGRAMS_PER_SM_64_2_3 -> 64/2/3, >= MIN_PROGRAMS_PER_SM_64_4_2 -> 64/4/2,
    else 128/4/2, for `max_seq_len <= SHORT_CONTEXT` (measured up to ~2,000 keys).
    """
    block_m = max(16, next_power_of_2(group))
    if not on_gpu:
        return AttentionTiles(block_m, 16, 4, 1)
    if head_dim > 256:  # 512-wide heads: see WIDE_DECODE_TILES
        wide = WIDE_DECODE_TILES
        return AttentionTiles(block_m, wide.block_n, wide.num_warps, wide.num_stages)
    if head_dim > 128 or elem_size > 2:
        return AttentionTiles(block_m, 64, 4, 2)
    if head_dim == 128 and block_m == 16 and 0 < max_seq_len <= SHORT_CONTEXT:
        if num_programs >= MIN_PROGRAMS_PER_SM_64_2_3 * num_sms:
            return AttentionTiles(block_m, 64, 2, 3)
        if num_programs >= MIN_PROGRAMS_PER_SM_64_4_2 * num_sms:
            return AttentionTiles(block_m, 64, 4, 2)
    return AttentionTiles(block_m, 128, 4, 2 if head_dim == 128 else 3)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (read once); a small stand-in elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter runs: any small number; the rule only shapes the grid


def modelled_split_cost(
    num_rows: int, num_kv_heads: int, seq_len: int, num_sms: int, block_n: int, splits: int
) -> float:
    """Decode time in KV-tile steps of one program: a program's tiles (+1 for its fixed cost: query load,
    partial write, reduce), times how many programs share each resident slot (at least 1).

    Below one full set of resident programs the time is one program's length (latency bound); above, it is
    the total work over the slots (bandwidth bound). Continuous in the number of programs, unlike a model
    of whole waves, whose hard steps real memory-bound kernels do not show.
    """
    programs = max(1, num_rows * num_kv_heads) * splits
    tiles = cdiv(cdiv(max(1, seq_len), splits), block_n)
    return max(1.0, programs / (PROGRAMS_PER_SM * num_sms)) * (tiles + 1)


@functools.lru_cache(maxsize=4096)
def num_kv_splits(num_rows: int, num_kv_heads: int, max_seq_len: int, num_sms: int, block_n: int = 64) -> int:
    """KV splits per (row, KV head) for a batch of small rows (decode, draft verification).

    A fixed rule, no measurement: the fewest splits that minimise `modelled_split_cost`, with no split
    shorter than `MIN_SPLIT_TOKENS` keys. The modelled time is then non-decreasing in the batch size and
    the split count shrinks gradually as rows are added, so there is no batch size where splitting stops
    and latency doubles. Cached: every layer of a step asks the same question.
    """
    max_splits = max(1, min(MAX_KV_SPLITS, cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)))
    costs = [
        modelled_split_cost(num_rows, num_kv_heads, max_seq_len, num_sms, block_n, s) for s in range(1, max_splits + 1)
    ]
    return 1 + costs.index(min(costs))
