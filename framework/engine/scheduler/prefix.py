"""The scheduler's prefix-cache steps: a waiting request's cache hit at admission, and state snapshots.

Functions of the KV cache manager and one request, so that `Scheduler.schedule` reads as its passes; the
policy (which hits are usable, where snapshots live) is in `KVCacheManager` and its `PrefixCacheHooks`.
"""

from __future__ import annotations

from typing import Callable

from framework.engine.request import Request
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.kv_transfer.interface import KVConnector
from framework.params.kv_transfer import KVConnectorOutput
from framework.params.scheduler_output import StateSnapshot


def may_read_prefix_cache(request: Request) -> bool:
    """False for requests that need every prompt position computed: prompt logprobs score each prompt token
    from the hidden state before it, and mean / CLS pooling read the hidden states of every / the first prompt
    token. They still publish their blocks for others."""
    if request.sampling_params.prompt_logprobs is not None:
        return False
    pooling = request.pooling_params
    return pooling is None or pooling.pooling_type in (None, "last")


def cache_hit(kv: KVCacheManager, request: Request, connector: KVConnector) -> tuple[list[int], int]:
    """(cached blocks a waiting request (new, or preempted: it holds no block) starts with, tokens after them
    that the KV connector's tier holds). At most `num_tokens - 1` tokens are hit, so its last token is computed
    and yields logits; requests that need the hidden state of every prompt token read nothing
    (`may_read_prefix_cache`)."""
    if not kv.enable_prefix_caching or not may_read_prefix_cache(request):
        return [], 0
    blocks = kv.find_cached_blocks(request, request.num_tokens - 1)
    return blocks, connector.num_external_hit_tokens(request, len(blocks) * kv.block_size, request.num_tokens - 1)


def admit_cache_hit(
    kv: KVCacheManager,
    request: Request,
    num_hit: int,
    num_scheduled: int,
    connector: KVConnector,
    load_blocks: list[int],
) -> list[tuple[int, int]]:
    """The request was admitted with `num_hit` tokens from the cache, the last `len(load_blocks)` blocks of them
    loaded into `load_blocks` from the KV connector's tier: skip them, count the device-cache lookup, and publish
    the blocks it loads and computes this step (returned as `KVCacheManager.cache_blocks` returns them)."""
    if not kv.enable_prefix_caching:
        return []
    num_external = len(load_blocks) * kv.block_size
    if num_external:
        connector.on_blocks_allocated(request, load_blocks, num_hit - num_external, num_external)
    if may_read_prefix_cache(request):
        kv.record_lookup(request.num_tokens, num_hit - num_external)
    if not request.num_preemptions:
        request.num_cached_tokens = num_hit
    request.num_computed_tokens = num_hit
    return kv.cache_blocks(request, num_hit + num_scheduled)


def recompute_failed_loads(
    kv: KVCacheManager, running: list[Request], output: KVConnectorOutput, preempt: Callable[[Request], None]
) -> bool:
    """Preempt (newest first) every running request holding a block whose load failed, after unpublishing its
    blocks from the first failed one on (their KV is, or was computed from, invalid KV): each recomputes its
    tokens, so its output is unchanged. Returns whether any was; then no request may be admitted in the next
    step, so that the preempted ones' tokens of this step, still in flight, are dropped when they arrive."""
    holders = []
    for request in reversed(running):
        blocks = kv.blocks_of(request.request_id)
        first = next((i for i, block in enumerate(blocks) if block in output.failed_block_ids), None)
        if first is not None:
            kv.unpublish(blocks[first:])
            holders.append(request)
    for request in holders:
        preempt(request)
    return bool(holders)


def take_snapshots(
    kv: KVCacheManager,
    batch_row: int,
    computed_before: int,
    num_tokens: int,
    offered: list[tuple[int, int]],
    out: list[StateSnapshot],
) -> None:
    """Ask for a state snapshot at the end of every block just offered to the cache whose end this row
    reaches this step: after `0..num_tokens` of its tokens (drafts excluded: they may be rejected).

    0 is the state before the step: a block published one step late (async scheduling: its last token was
    not on the host yet) ends where the previous step left the state. `computed_before` is exact whenever
    such a boundary is at or after it: it overcounts only while drafts are in flight, and then the
    published blocks, whose tokens are all on the host, end before it.
    """
    hooks = kv.hooks
    if not hooks.takes_snapshots or not offered:
        return
    row: list[StateSnapshot] = []
    for index, block in reversed(offered):  # the longest prefix first: if slots run short, it ends longer hits
        at = (index + 1) * kv.block_size - computed_before
        if 0 <= at <= num_tokens:
            slot = hooks.assign_snapshot(block)
            if slot is not None:
                row.append(StateSnapshot(batch_row, at, slot))
    out.extend(reversed(row))
