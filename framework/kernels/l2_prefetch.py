"""L2 prefetch of weights that later kernels of the step will read: HBM works while a latency-bound kernel runs.

At batch 1 a decoder layer reads ~31 MB of projection weights and ~6 MB of KV, ~9 µs of HBM time at 4 TB/s, yet
takes ~26 µs: the paged attention (~9 µs) is a chain of dependent loads that leaves HBM nearly idle, and each
GEMV spends part of its time ramping up. A prefetch kernel launched before the attention asks the L2 (50 MB on
an H100 / H200) for the weights of the layer's next GEMVs (o_proj, gate/up, down) and of the next layer's qkv,
so that they stream while the attention waits on its own loads; the GEMVs then read them from L2.

One prefetch is one Hopper bulk prefetch (`cp.async.bulk.prefetch.L2`, sm_90) of up to `CHUNK` bytes, issued by
one lane; `L2::evict_last` keeps the lines over the KV that streams through at the same time. A prefetch is a
hint: it changes no value anywhere, so the results are the same bits with and without it (tests/gpu checks).

Under programmatic dependent launch the prefetches are issued before `gdc_wait` (weights are never written),
and the kernel waits before it exits, as every kernel of a PDL chain must (the next kernel's wait covers only
this one). Not under Triton's interpreter (no inline PTX) and not on GPUs older than Hopper: `l2_prefetch`
does nothing there.
"""

from __future__ import annotations

import logging
import os
from typing import Literal, NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from framework.kernels.launch_math import cdiv
from framework.kernels.pdl import pdl_launch_kwargs

CHUNK_BYTES = 16 * 1024  # bytes per bulk prefetch (a multiple of 16)
LANES = 128  # prefetches per program (one per thread at 4 warps)
MAX_REGIONS = 4

logger = logging.getLogger(__name__)


@triton.jit
def _bulk_prefetch_l2(address, nbytes):  # [BLOCK] int64 addresses, [BLOCK] int32 sizes (0: nothing to fetch)
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .b64 policy;
        setp.gt.s32 p, $2, 0;
        createpolicy.fractional.L2::evict_last.b64 policy, 1.0;
        @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, policy;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [address, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _line_prefetch_l2(address, nbytes):  # one 128-byte line per lane (a fallback to compare with the bulk form)
    return tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        setp.gt.s32 p, $2, 0;
        @p prefetch.global.L2::evict_last [$1];
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [address, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _chunk_span(i, a0, a1, a2, a3, n0, n1, n2, n3, c1, c2, c3, total, CHUNK: tl.constexpr):
    """(start address int64, bytes int32; 0 past the end) of chunks `i` over up to 4 regions laid end to end."""
    region_start = tl.where(i < c1, a0, tl.where(i < c2, a1, tl.where(i < c3, a2, a3)))
    region_bytes = tl.where(i < c1, n0, tl.where(i < c2, n1, tl.where(i < c3, n2, n3))).to(tl.int64)
    first = tl.where(i < c1, 0, tl.where(i < c2, c1, tl.where(i < c3, c2, c3)))
    offset = (i - first).to(tl.int64) * CHUNK
    size = tl.minimum(region_bytes - offset, CHUNK)
    return region_start + offset, tl.where((i < total) & (size > 0), size, 0).to(tl.int32)


@triton.jit
def _l2_prefetch_kernel(
    a0, a1, a2, a3,  # int64 start addresses of up to 4 regions (16-byte aligned)
    n0, n1, n2, n3,  # their sizes in bytes (multiples of 16; 0: unused)
    c1, c2, c3, total,  # chunk index where regions 1, 2, 3 start; chunks in all
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    BULK: tl.constexpr,  # cp.async.bulk.prefetch of CHUNK bytes per lane, else one 128-byte line per lane
    USE_PDL: tl.constexpr = False,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] chunk index over the regions in order
    address, size = _chunk_span(i, a0, a1, a2, a3, n0, n1, n2, n3, c1, c2, c3, total, CHUNK)
    if BULK:
        _bulk_prefetch_l2(address, size)
    else:
        _line_prefetch_l2(address, size)
    if USE_PDL:  # must wait before exiting: the next kernel's gdc_wait covers this kernel only
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


class PrefetchPlan(NamedTuple):
    """The static launch of one prefetch: region addresses and sizes (padded to 4), chunk boundaries, grid."""

    addresses: tuple[int, int, int, int]
    sizes: tuple[int, int, int, int]
    starts: tuple[int, int, int]  # chunk index where regions 1..3 start
    total: int  # chunks
    grid: int
    chunk: int


def prefetch_plan(regions: Sequence[torch.Tensor], chunk: int = CHUNK_BYTES, lanes: int = LANES) -> PrefetchPlan:
    """The plan for prefetching `regions` (contiguous tensors, at most 4) in chunks of `chunk` bytes; a region's
    last chunk is cut to its end, which is rounded down to 16 bytes (the bulk prefetch's unit)."""
    assert len(regions) <= MAX_REGIONS, f"{len(regions)} regions > {MAX_REGIONS}"
    assert chunk % 16 == 0 and chunk > 0, f"chunk {chunk}: a positive multiple of 16"
    addresses, sizes, chunks = [], [], []
    for t in regions:
        assert t.is_contiguous(), "a prefetch region is one contiguous tensor"
        addresses.append(t.data_ptr())
        sizes.append(t.numel() * t.element_size() // 16 * 16)
        chunks.append(cdiv(sizes[-1], chunk))
    while len(addresses) < MAX_REGIONS:
        addresses.append(addresses[-1] if addresses else 0)
        sizes.append(0)
        chunks.append(0)
    starts = (chunks[0], chunks[0] + chunks[1], chunks[0] + chunks[1] + chunks[2])
    total = sum(chunks)
    return PrefetchPlan(tuple(addresses), tuple(sizes), starts, total, cdiv(total, lanes), chunk)  # type: ignore


def l2_prefetch_unsupported_reason(device: torch.device) -> str:
    """Why `l2_prefetch` does nothing on `device` ("" when it works): the bulk prefetch is Hopper's (sm_90)
    inline PTX, which Triton's interpreter cannot run."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "Triton's interpreter runs no inline PTX"
    if device.type != "cuda":
        return f"device {device} is not a CUDA GPU"
    if torch.cuda.get_device_capability(device) < (9, 0):
        return f"compute capability {torch.cuda.get_device_capability(device)} < 9.0 (bulk prefetch is sm_90)"
    return ""


def l2_prefetch_supported(device: torch.device) -> bool:
    """Whether `l2_prefetch` launches anything on `device` (see `l2_prefetch_unsupported_reason`)."""
    return not l2_prefetch_unsupported_reason(device)


def resolve_l2_prefetch(mode: Literal["auto", "on", "off"], device: torch.device) -> bool:
    """`model.l2_prefetch` on `device`: `off` never; `auto` where supported; `on` the same, but an unsupported
    device is logged as a warning (it was asked for)."""
    reason = "" if mode == "off" else l2_prefetch_unsupported_reason(device)
    if reason and mode == "on":
        logger.warning("L2 prefetch off: %s (model.l2_prefetch=on)", reason)
    return mode != "off" and not reason


def l2_prefetch(plan: PrefetchPlan, device: torch.device, pdl: bool = False, bulk: bool = True) -> None:
    """Launch the prefetch of `plan` on the current stream (nothing where `l2_prefetch_supported` says no, or for
    an empty plan). `pdl`: launched with programmatic dependent launch, as the kernels around it."""
    if plan.total == 0 or not l2_prefetch_supported(device):
        return
    chunk = plan.chunk if bulk else 128
    if not bulk:  # one line per lane: re-plan the same regions by 128-byte lines
        lines = [cdiv(n, 128) for n in plan.sizes]
        starts = (lines[0], lines[0] + lines[1], lines[0] + lines[1] + lines[2])
        total, grid = sum(lines), cdiv(sum(lines), LANES)
    else:
        starts, total, grid = plan.starts, plan.total, plan.grid
    _l2_prefetch_kernel[(grid,)](*plan.addresses, *plan.sizes, *starts, total, CHUNK=chunk, BLOCK=LANES,
                                 BULK=bulk, num_warps=LANES // 32, **pdl_launch_kwargs(pdl))
