"""Ranks of a multi-node tensor / pipeline parallel run started by Ray: one placement-group bundle per rank (one
GPU each), one process per bundle with the env rendezvous `torchrun` would set (MASTER_ADDR / MASTER_PORT of rank
0's node, RANK, WORLD_SIZE, LOCAL_RANK), so mrv2 joins them exactly as it joins `torchrun`'s ranks and the driver
is rank 0.

    python -m framework.executor.ray_launch --world-size 2 -- \\
        python -m framework.entrypoints.cli serve parallel.tensor_parallel_size=2 serve.host=0.0.0.0

connects to the Ray cluster `ray.init()` finds (RAY_ADDRESS, or one started on this machine; else a local one).
Ray itself is imported only here (`pip install "mrv2[ray]"`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Any, Optional, Sequence


class RankProcess:
    """One bundle's process: reports its node and a free port there, then runs the rank's command."""

    def node(self) -> tuple[str, int]:
        import ray

        from framework.executor.launch import free_port

        return ray.util.get_node_ip_address(), free_port()

    def run(self, command: Sequence[str], env: dict[str, str]) -> int:
        return subprocess.run(list(command), env={**os.environ, **env}, check=False).returncode


def rank_envs(nodes: Sequence[str], master_port: int, gpus_per_rank: int) -> list[dict[str, str]]:
    """Each rank's rendezvous variables, ranks in bundle order: the master is rank 0's node. With GPUs, Ray shows
    each rank only its own (CUDA_VISIBLE_DEVICES), so LOCAL_RANK is 0; on the CPU it counts the node's ranks."""
    envs, seen = [], {}
    for rank, node in enumerate(nodes):
        local = 0 if gpus_per_rank else seen.get(node, 0)
        seen[node] = seen.get(node, 0) + 1
        envs.append(
            {
                "MASTER_ADDR": nodes[0],
                "MASTER_PORT": str(master_port),
                "RANK": str(rank),
                "WORLD_SIZE": str(len(nodes)),
                "LOCAL_RANK": str(local),
            }
        )
    return envs


def launch(
    command: Sequence[str],
    world_size: int,
    gpus_per_rank: int = 1,
    cpus_per_rank: float = 1,
    env: Optional[dict[str, str]] = None,
    timeout_s: Optional[float] = None,
    strategy: str = "PACK",
) -> list[int]:
    """Run `command` once per rank in a placement group of `world_size` bundles ({"GPU": gpus_per_rank, "CPU":
    cpus_per_rank} each) on the Ray cluster `ray.init` reached; returns the ranks' exit codes. The group and its
    actors are removed at the end, also on a timeout (`ray.exceptions.GetTimeoutError`)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundle: dict[str, float] = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
    group = placement_group([dict(bundle) for _ in range(world_size)], strategy=strategy)
    actors: list[Any] = []
    try:
        ray.get(group.ready(), timeout=timeout_s)
        remote = ray.remote(RankProcess)
        for index in range(world_size):
            placement = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
            options = {"num_cpus": cpus_per_rank, "num_gpus": gpus_per_rank, "scheduling_strategy": placement}
            actors.append(remote.options(**options).remote())
        places = ray.get([actor.node.remote() for actor in actors], timeout=timeout_s)
        envs = rank_envs([ip for ip, _ in places], places[0][1], gpus_per_rank)
        runs = [actor.run.remote(list(command), {**(env or {}), **e}) for actor, e in zip(actors, envs)]
        return list(ray.get(runs, timeout=timeout_s))
    finally:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks (bundles)")
    parser.add_argument("--gpus-per-rank", type=int, default=1)
    parser.add_argument("--cpus-per-rank", type=float, default=1)
    parser.add_argument("--strategy", default="PACK", help="placement strategy (PACK, SPREAD, STRICT_SPREAD, ...)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then each rank's command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command: put it after --")
    import ray

    ray.init()
    codes = launch(command, args.world_size, args.gpus_per_rank, args.cpus_per_rank, strategy=args.strategy)
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
