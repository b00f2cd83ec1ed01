"""The device-free core of `tune_moe_tiles.py`: the geometries, the candidate tiles per token count, the shared
memory bound, the choice of the winning pair of tiles and the JSON the sweep writes.

Both kernels walk the same expert-sorted blocks of `block_m` rows (one `moe_align` a launch), so the winner is the
`block_m` whose best gate/up time plus best down time is least, each kernel with its own block_n, block_k, warps
and stages at that `block_m`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Optional

from framework.layers.kernels.moe_launch import MoeLaunchConfig, heuristic_launch_config

KERNELS = ("gate_up", "down")
TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
QUICK_TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
H100_SHARED_MEMORY = 227 * 1024  # bytes a block may opt into on sm_90


@dataclass(frozen=True)
class Geometry:
    """One MoE layer's expert shape (on one rank)."""

    name: str
    experts: int  # E
    top_k: int
    hidden: int  # H (the table's k)
    intermediate: int  # I (the table's n)


GEOMETRIES = {
    g.name: g
    for g in (
        Geometry("qwen3-30b-a3b", 128, 8, 2048, 768),
        Geometry("gpt-oss-20b", 32, 4, 2880, 2880),
        Geometry("qwen3-moe-tiny", 8, 2, 64, 48),
    )
}


@dataclass(frozen=True)
class Grid:
    """The tile values a sweep tries (block_m is cut per token count: `block_m_options`)."""

    block_m: tuple[int, ...] = (16, 32, 64, 128)
    block_n: tuple[int, ...] = (32, 64, 128, 256)
    block_k: tuple[int, ...] = (64, 128, 256)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)


FULL_GRID = Grid()
QUICK_GRID = Grid(block_m=(16, 32, 64), block_n=(32, 64, 128), block_k=(64, 128), num_warps=(4, 8), num_stages=(3, 4))


def block_m_options(grid: Grid, tokens: int, geometry: Geometry) -> tuple[int, ...]:
    """Row blocks worth trying for `tokens`: up to 4x the mean rows per expert (16 at least: tl.dot's minimum).
    Taller blocks would be mostly padding at that size."""
    rows_per_expert = -(-tokens * geometry.top_k // geometry.experts)
    return tuple(bm for bm in grid.block_m if bm <= max(16, 4 * rows_per_expert))


def shared_memory_bytes(kernel: str, cfg: MoeLaunchConfig, element_bytes: int) -> int:
    """A bound on the pipelined tiles' shared memory: `num_stages` copies of the activation tile and the weight
    tiles (gate/up reads two: gate and up)."""
    weight_tiles = 2 if kernel == "gate_up" else 1
    return cfg.num_stages * (cfg.block_m + weight_tiles * cfg.block_n) * cfg.block_k * element_bytes


def candidates(
    kernel: str, tokens: int, geometry: Geometry, grid: Grid, element_bytes: int, shared_memory: int
) -> list[MoeLaunchConfig]:
    """The tiles to time for one kernel at one token count: the grid cut by `block_m_options` and the shared
    memory, tiles no wider than the output or the reduction needs, plus the heuristic's (the baseline)."""
    n, k = (geometry.intermediate, geometry.hidden) if kernel == "gate_up" else (geometry.hidden, geometry.intermediate)
    found = [heuristic_launch_config(tokens * geometry.top_k, geometry.experts)]
    for bm in block_m_options(grid, tokens, geometry):
        for bn in _useful(grid.block_n, n):
            for bk in _useful(grid.block_k, k):
                for warps in grid.num_warps:
                    for stages in grid.num_stages:
                        cfg = MoeLaunchConfig(bm, bn, bk, warps, stages)
                        if cfg not in found and shared_memory_bytes(kernel, cfg, element_bytes) <= shared_memory:
                            found.append(cfg)
    return found


def _useful(sizes: tuple[int, ...], extent: int) -> list[int]:
    """The sizes up to the first that covers `extent` (wider tiles would only add masked lanes)."""
    kept = [s for s in sizes if s < extent]
    return kept + [s for s in sizes if s >= extent][:1]


@dataclass(frozen=True)
class Measurement:
    """One kernel's time under one tile set at one token count (`ms` None: it failed to compile or launch)."""

    kernel: str
    tokens: int
    cfg: MoeLaunchConfig
    ms: Optional[float]
    error: Optional[str] = None

    def to_json(self) -> dict:
        tiles = {name: getattr(self.cfg, name) for name in MoeLaunchConfig._fields[:5]}
        return {**{k: v for k, v in asdict(self).items() if k != "cfg"}, "tiles": tiles}


def measure(
    kernel: str, tokens: int, configs: Iterable[MoeLaunchConfig], time_ms: Callable[[MoeLaunchConfig], float]
) -> list[Measurement]:
    """`time_ms` of every config; a config that raises (no compile, too much shared memory) is kept as an error."""
    results = []
    for cfg in configs:
        try:
            results.append(Measurement(kernel, tokens, cfg, float(time_ms(cfg))))
        except Exception as exc:  # Triton raises many kinds (OutOfResources, CompilationError, ...)
            results.append(Measurement(kernel, tokens, cfg, None, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return results


def pick_winner(measurements: Iterable[Measurement]) -> tuple[MoeLaunchConfig, float]:
    """(the launch config, its gate/up + down ms) of one token count: the `block_m` with the least sum of the two
    kernels' best times, the down kernel's tiles in `down` when they differ. `ValueError` if no `block_m` has a
    timed config of both kernels."""
    best: dict[tuple[str, int], Measurement] = {}
    for m in measurements:
        key = (m.kernel, m.cfg.block_m)
        if m.ms is not None and (key not in best or m.ms < best[key].ms):  # type: ignore[operator]
            best[key] = m
    pairs = [
        (best["gate_up", bm].ms + best["down", bm].ms, best["gate_up", bm].cfg, best["down", bm].cfg)  # type: ignore[operator]
        for bm in sorted({bm for _, bm in best})
        if ("gate_up", bm) in best and ("down", bm) in best
    ]
    if not pairs:
        raise ValueError("no block_m has a timed configuration of both kernels")
    total, gate_up, down = min(pairs, key=lambda pair: pair[0])
    return (gate_up if down == gate_up else gate_up._replace(down=down)), total


def moved_bytes(geometry: Geometry, tokens: int, experts_touched: int, element_bytes: int) -> dict[str, int]:
    """Bytes each kernel must move at least: every touched expert's weights once, the activations in and out."""
    rows, h, i = tokens * geometry.top_k, geometry.hidden, geometry.intermediate
    return {
        "gate_up": element_bytes * (experts_touched * 2 * i * h + rows * h + rows * i),
        "down": element_bytes * (experts_touched * h * i + rows * i + rows * h),
    }
