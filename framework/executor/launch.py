"""Starting a parallel run: checks, rank devices and process groups (the driver spawns the worker processes).

mrv2 launches its ranks itself (one spawned process per rank besides this one, rendezvous on a free local
port), or joins the ranks `torchrun` started (RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT).
"""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any, NamedTuple, Optional

import torch

from framework.config.schema import ConfigError, Mrv2Config
from framework.layers.parallel.context import ParallelContext

logger = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=7)  # ranks wait this long for the driver's next command (an idle engine is fine)


class RankPlace(NamedTuple):
    """Where this process joins: its global rank, its local device index and the rendezvous address."""

    rank: int
    local_rank: int
    init_method: str


def torchrun_place(config: Mrv2Config) -> Optional[RankPlace]:
    """This process's place when `torchrun` started it (WORLD_SIZE set), else None; the world must match."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != config.parallel.world_size:
        raise ConfigError(
            f"torchrun started {world} processes but parallel.tensor_parallel_size x parallel.pipeline_parallel_size "
            f"= {config.parallel.world_size}: start as many processes as ranks"
        )
    return RankPlace(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"])), "env://")


def check_parallel_config(config: Mrv2Config, hf_config: dict[str, Any]) -> None:
    """Refuse a parallel layout the model or the machine cannot run (`ConfigError` naming the keys)."""
    p = config.parallel
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    heads = int(hf_config.get("num_attention_heads", 0))
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    layers = int(hf_config.get("num_hidden_layers", 0))
    problems = []
    if heads % tp:
        problems.append(f"the model's {heads} attention heads do not divide by parallel.tensor_parallel_size={tp}")
    if kv_heads % tp:
        problems.append(
            f"the model's {kv_heads} KV heads do not divide by parallel.tensor_parallel_size={tp} "
            "(KV heads are split, not replicated)"
        )
    linear_k_heads = int(hf_config.get("linear_num_key_heads") or 0)  # Gated DeltaNet layers (Qwen3.5 / Qwen3-Next)
    if linear_k_heads % tp:
        problems.append(
            f"the model's {linear_k_heads} linear-attention key heads (linear_num_key_heads) do not divide by "
            f"parallel.tensor_parallel_size={tp}"
        )
    if layers < pp:
        problems.append(f"the model has {layers} layers, fewer than parallel.pipeline_parallel_size={pp} stages")
    if rank_device_type(config) == "cuda":
        problems.extend(_device_problems(p.world_size))
    if problems:
        raise ConfigError("invalid parallel layout:\n  " + "\n  ".join(problems))


def _device_problems(world_size: int) -> list[str]:
    """Too few visible CUDA devices: for every rank when mrv2 spawns them; for this process's LOCAL_RANK when a
    launcher (`torchrun`, Ray) started the ranks, each node seeing only its own devices."""
    visible = torch.cuda.device_count()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        local_rank = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        if local_rank < visible:
            return []
        return [f"LOCAL_RANK={local_rank} needs device cuda:{local_rank}, but only {visible} CUDA devices are visible"]
    if world_size <= visible:
        return []
    return [
        f"parallel.tensor_parallel_size x parallel.pipeline_parallel_size = {world_size} ranks, "
        f"but only {visible} CUDA devices are visible"
    ]


def rank_device_type(config: Mrv2Config) -> str:
    """ "cuda" or "cpu": one device per rank of that type."""
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA device is available (use device=cpu or device=auto)")
    return config.device


def rank_device(config: Mrv2Config, local_rank: int) -> torch.device:
    """This rank's device: cuda:<local rank> (made current) or the CPU."""
    if rank_device_type(config) == "cuda":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_groups(config: Mrv2Config, place: RankPlace, device: torch.device) -> ParallelContext:
    """Join the rendezvous and create the groups: world (step backend), tensor groups per stage, gloo commands."""
    import torch.distributed as dist

    p = config.parallel
    backend = p.backend if p.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=p.timeout_s)
    kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(
        backend, init_method=place.init_method, rank=place.rank, world_size=p.world_size, timeout=timeout, **kwargs
    )
    tp, pp = p.tensor_parallel_size, p.pipeline_parallel_size
    tp_group = None  # the world group when there is one stage
    if pp > 1 and tp > 1:
        for stage in range(pp):  # every rank creates every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if place.rank // tp == stage:
                tp_group = group
    cpu_group = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return ParallelContext(tp, pp, place.rank, tp_group=tp_group, device_group=dist.group.WORLD, cpu_group=cpu_group)
