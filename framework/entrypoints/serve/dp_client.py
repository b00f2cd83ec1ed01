"""Data parallelism on one host: `parallel.data_parallel_size=N` engine-core processes behind the one API server.

`DataParallelClient` has the `EngineClient` interface the endpoints use (`add`, `abort`, `release`, `stats`,
`dead`, `ranks`, ...) over N `EngineClient`s, one per rank, each with its own process, device and KV pool. A
request goes to one rank (`pick_rank`): among the live ranks whose requests in flight are within
`parallel.data_parallel_locality_slack` of the least loaded one, the rank most likely to hold its prompt's
leading KV blocks (`PrefixLocality`, the API server's record of which rank saw which block hashes), then the
least loaded. A rank that dies fails only its own requests; the others keep serving.
"""

from __future__ import annotations

import asyncio
import os
from collections import OrderedDict
from typing import Literal, Optional, Sequence

from framework.config.schema import Mrv2Config
from framework.engine.parallel_sampling import CHILD_SEPARATOR
from framework.entrypoints.serve.engine_client import EngineClient, EngineStartError, RankState, StreamItem
from framework.entrypoints.serve.protocol import EngineReady, EngineStats
from framework.entrypoints.serve.stream_inbox import ItemSink
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import PoolingParams
from framework.params.prefix_cache import ROOT_HASH, BlockHash, hash_block
from framework.params.sampling_params import SamplingParams

MAX_LOCALITY_BLOCKS = 64  # leading blocks of a prompt the balancer hashes (enough to tell shared prefixes apart)


class PrefixLocality:
    """Which ranks were sent which leading KV blocks (the prefix cache's own chained hashes), least recently
    used first; at most `capacity` hashes (the ranks' KV blocks together: they cannot cache more)."""

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._ranks: OrderedDict[BlockHash, set[int]] = OrderedDict()

    def hashes(self, prompt: Sequence[int]) -> list[BlockHash]:
        """The chained hashes of the prompt's leading full blocks (up to MAX_LOCALITY_BLOCKS)."""
        out: list[BlockHash] = []
        num_full = min(len(prompt) // self.block_size, MAX_LOCALITY_BLOCKS)
        for index in range(num_full):
            block = prompt[index * self.block_size : (index + 1) * self.block_size]
            out.append(hash_block(out[-1] if out else ROOT_HASH, block))
        return out

    def matches(self, hashes: Sequence[BlockHash], num_ranks: int) -> list[int]:
        """Per rank: how many of the leading blocks it was sent, in a row from the first."""
        counts = [0] * num_ranks
        alive = set(range(num_ranks))
        for block_hash in hashes:
            alive &= self._ranks.get(block_hash, set())
            if not alive:
                break
            for rank in alive:
                counts[rank] += 1
        return counts

    def record(self, hashes: Sequence[BlockHash], rank: int) -> None:
        for block_hash in hashes:
            self._ranks.setdefault(block_hash, set()).add(rank)
            self._ranks.move_to_end(block_hash)
        while len(self._ranks) > self.capacity:
            self._ranks.popitem(last=False)


def pick_rank(loads: Sequence[Optional[int]], matches: Sequence[int], slack: int) -> int:
    """The rank for a request: `loads[r]` is rank r's requests in flight (None: dead), `matches[r]` its leading
    blocks of the prompt. Among live ranks within `slack` of the least load: most matched blocks, then least
    load, then lowest rank. Raises `ValueError` when no rank is alive."""
    live = [r for r, load in enumerate(loads) if load is not None]
    if not live:
        raise ValueError("no data-parallel rank is alive")
    least = min(loads[r] for r in live)  # type: ignore[type-var]
    near = [r for r in live if loads[r] <= least + slack]  # type: ignore[operator]
    return min(near, key=lambda r: (-matches[r], loads[r], r))


def rank_env(config: Mrv2Config, rank: int) -> Optional[dict[str, str]]:
    """The environment of rank `rank`'s engine process: its own GPUs (`world_size` of them, from the visible
    ones) unless the run is on the CPU."""
    if config.device == "cpu":
        return None
    world = config.parallel.world_size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(world * config.parallel.data_parallel_size)]
    mine = devices[rank * world : (rank + 1) * world]
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(mine)} if mine else None


def _sum_stats(stats: list[EngineStats]) -> Optional[EngineStats]:
    if not stats:
        return None
    return EngineStats(*(sum(getattr(s, f) for s in stats) for f in EngineStats.__struct_fields__))


class DataParallelClient:
    """N engine cores behind one `EngineClient`-shaped object (see the module docstring)."""

    def __init__(self, config: Mrv2Config) -> None:
        self.config = config
        size = config.parallel.data_parallel_size
        self.clients = [EngineClient(config, rank, rank_env(config, rank)) for rank in range(size)]
        self._rank_of: dict[str, int] = {}
        self._locality = PrefixLocality(config.cache.block_size, 1 << 16)
        self._slack = config.parallel.data_parallel_locality_slack

    @property
    def info(self) -> Optional[EngineReady]:
        return self.clients[0].info

    @property
    def stats(self) -> Optional[EngineStats]:
        """The live ranks' stats, summed."""
        return _sum_stats([c.stats for c in self.clients if c.dead is None and c.stats is not None])

    @property
    def dead(self) -> Optional[str]:
        """Why the server cannot serve: set only once every rank is dead."""
        if all(c.dead is not None for c in self.clients):
            return "; ".join(f"data-parallel rank {c.rank}: {c.dead}" for c in self.clients)
        return None

    @property
    def num_in_flight(self) -> int:
        return sum(c.num_in_flight for c in self.clients)

    def ranks(self) -> list[RankState]:
        return [c.ranks()[0] for c in self.clients]

    async def start(self, timeout_s: float) -> EngineReady:
        """Start every rank (concurrently); any rank failing to start fails the start-up."""
        results = await asyncio.gather(*(c.start(timeout_s) for c in self.clients), return_exceptions=True)
        for rank, result in enumerate(results):
            if isinstance(result, BaseException):
                raise EngineStartError(f"data-parallel rank {rank}: {result}")
        blocks = sum(c.stats.num_blocks for c in self.clients if c.stats is not None)
        self._locality.capacity = max(blocks, 1)
        ready = results[0]
        assert isinstance(ready, EngineReady)
        return ready

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        queue: ItemSink[StreamItem],
        sampling_params: Optional[SamplingParams] = None,
        pooling_params: Optional[PoolingParams] = None,
        lora: Optional[LoRARequest] = None,
    ) -> None:
        """Send the request to the rank `pick_rank` chooses (a dead server fails it as one rank would)."""
        loads = [c.num_in_flight if c.dead is None else None for c in self.clients]
        hashes = self._locality.hashes(prompt_token_ids)
        try:
            rank = pick_rank(loads, self._locality.matches(hashes, len(self.clients)), self._slack)
        except ValueError:
            rank = 0  # every rank is dead: rank 0's client fails the request with its reason
        self._locality.record(hashes, rank)
        self._rank_of[request_id] = rank
        self.clients[rank].add(request_id, prompt_token_ids, queue, sampling_params, pooling_params, lora)

    def _rank_for(self, engine_id: str) -> Optional[int]:
        rank = self._rank_of.get(engine_id)
        if rank is None and CHILD_SEPARATOR in engine_id:  # one sequence of a request with n > 1
            rank = self._rank_of.get(engine_id.rsplit(CHILD_SEPARATOR, 1)[0])
        return rank

    def abort(self, engine_ids: list[str]) -> None:
        """Abort each request (or sequence) in the rank that runs it."""
        by_rank: dict[int, list[str]] = {}
        for engine_id in engine_ids:
            rank = self._rank_for(engine_id)
            if rank is not None:
                by_rank.setdefault(rank, []).append(engine_id)
        for rank, ids in by_rank.items():
            self.clients[rank].abort(ids)

    def release(self, request_id: str) -> None:
        rank = self._rank_of.pop(request_id, None)
        if rank is not None:
            self.clients[rank].release(request_id)

    def fail_all(self, message: str, kind: Literal["dead", "shutdown"]) -> None:
        for client in self.clients:
            client.fail_all(message, kind)

    def begin_shutdown(self) -> None:
        for client in self.clients:
            client.begin_shutdown()

    async def close(self, timeout_s: float = 5.0) -> None:
        await asyncio.gather(*(c.close(timeout_s) for c in self.clients))
