"""The KV footprint of a `mrv2 bench` run: the most KV blocks in use at any step, and what they cost per token.

Sampled once per step from the engine's KV manager by the bench's observer (`BenchCounters.on_step`, after the
scheduler allocated and window groups gave back for the step), never by the runner. With KV groups
(`cache.kv_groups`) one pool serves every group, so the blocks in use are the block ids held in any group, and a
block costs the groups' `S` layers (`kv_bytes_per_block`); without, every layer's. The ratio of two runs' bytes
per token (`cache.kv_groups=true` against `false`) is the saving docs/sliding-window.md#kv-memory computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from framework.engine.request import Request
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.models.setup import kv_bytes_per_block


def blocks_in_use(kv: KVCacheManager) -> int:
    """Block ids some request holds now, in any KV group (a block shared through the prefix cache counts once;
    cached blocks nobody holds are free)."""
    return kv.num_used_blocks


@dataclass(frozen=True)
class KVFootprintSummary:
    """The step of the timed run that held the most KV blocks (of those, the one with the most tokens)."""

    peak_blocks: int  # block ids in use, over every KV group
    block_bytes: int  # bytes of one block id: its layers' K and V (S layers with KV groups)
    tokens_at_peak: int  # tokens whose KV the running requests hold at that step (prompt + generated so far)

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.block_bytes

    @property
    def bytes_per_token(self) -> float:
        return self.peak_bytes / self.tokens_at_peak if self.tokens_at_peak else 0.0

    def result_fields(self) -> dict[str, Any]:
        """`BenchResult`'s KV footprint fields (framework/entrypoints/bench/throughput.py)."""
        return {
            "kv_peak_blocks": self.peak_blocks,
            "kv_block_bytes": self.block_bytes,
            "kv_peak_bytes": self.peak_bytes,
            "kv_tokens_at_peak": self.tokens_at_peak,
            "kv_bytes_per_token": self.bytes_per_token,
        }


class KVFootprint:
    """Tracks the peak of `blocks_in_use` over the steps it samples, and the tokens held at that step."""

    def __init__(self, kv: KVCacheManager, scheduler: Any, block_bytes: int) -> None:
        self.kv = kv
        self.scheduler = scheduler  # its `running` requests are read, never changed
        self.block_bytes = block_bytes
        self.peak_blocks = 0
        self.tokens_at_peak = 0

    @classmethod
    def of_engine(cls, engine: Any) -> "KVFootprint":
        """The footprint of `engine`'s (an `EngineCore`'s) KV cache; bytes per block as KV sizing counts them."""
        block_bytes = kv_bytes_per_block(
            engine.loaded, engine.config.cache.block_size, engine.runner.num_draft_kv_layers
        )
        return cls(engine.kv_cache, engine.scheduler, block_bytes)

    def sample(self) -> None:
        """Read the blocks in use and the tokens the running requests hold (`num_computed_tokens` already counts
        the tokens this step computes)."""
        blocks = blocks_in_use(self.kv)
        if blocks < self.peak_blocks:
            return
        running: list[Request] = self.scheduler.running
        tokens = sum(request.num_computed_tokens for request in running)
        if blocks > self.peak_blocks or tokens > self.tokens_at_peak:
            self.peak_blocks, self.tokens_at_peak = blocks, tokens

    def summary(self) -> KVFootprintSummary:
        return KVFootprintSummary(self.peak_blocks, self.block_bytes, self.tokens_at_peak)


def format_kv_footprint(peak_blocks: int, block_bytes: Optional[int], tokens_at_peak: Optional[int]) -> str:
    """The line `mrv2 bench` prints under its table: peak KV blocks, their bytes, the bytes per token held."""
    summary = KVFootprintSummary(peak_blocks, block_bytes or 0, tokens_at_peak or 0)
    return (
        f"KV footprint at peak: {peak_blocks} blocks x {summary.block_bytes} B = {summary.peak_bytes / 2**30:.3f} GiB "
        f"for {summary.tokens_at_peak} tokens held, {summary.bytes_per_token:.1f} B per token"
    )
