"""What routers poll besides /metrics: `/load` (queue depth, per data-parallel rank) and the state `/health` reports.

vLLM's `/load` answers `{"server_load": N}` (requests in flight); routers that balance on queue depth read that
key. mrv2 answers the same key plus the engine's gauges and one entry per engine core.
"""

from __future__ import annotations

from typing import Any, Optional

from framework.entrypoints.serve.engine_client import RankState


def _usage(rank: RankState) -> Optional[float]:
    s = rank.stats
    return None if s is None else (s.num_blocks - s.num_free_blocks) / max(s.num_blocks, 1)


def load_report(ranks: list[RankState]) -> dict[str, Any]:
    """`/load`'s body: `server_load` (requests in flight), the engine's queue gauges summed over live ranks,
    and `data_parallel`: per rank, whether it runs, its requests in flight, queue and KV usage."""
    live = [r for r in ranks if r.dead is None]
    ranks = [r if r.dead is None else r._replace(stats=None) for r in ranks]  # a dead rank holds nothing
    per_rank = [
        {
            "rank": r.rank,
            "alive": r.dead is None,
            "error": r.dead,
            "server_load": r.num_in_flight,
            "num_requests_running": r.stats.num_running if r.stats else 0,
            "num_requests_waiting": r.stats.num_waiting if r.stats else 0,
            "kv_cache_usage_perc": _usage(r),
        }
        for r in ranks
    ]
    return {
        "server_load": sum(r.num_in_flight for r in live),
        "num_requests_running": sum(r.stats.num_running for r in live if r.stats),
        "num_requests_waiting": sum(r.stats.num_waiting for r in live if r.stats),
        "data_parallel": per_rank,
    }


def health_problem(ranks: list[RankState]) -> tuple[Optional[str], Optional[str]]:
    """(why the server cannot serve, or None; which ranks are dead while others serve, or None): `/health`
    answers 503 with the first, and 200 with the second in its `X-Mrv2-Degraded` header."""
    dead = [r for r in ranks if r.dead is not None]
    if not dead:
        return None, None
    if len(dead) == len(ranks):
        return f"the engine is not running: {dead[0].dead}", None
    return None, "; ".join(f"data-parallel rank {r.rank}: {r.dead}" for r in dead)
