"""`ParallelContext`: where this process sits in the tensor x pipeline grid, and the collectives it joins.

Ranks are laid out stage-major: `rank = pp_rank * tp_size + tp_rank`, so the ranks of one stage are consecutive
(one tensor-parallel group per stage) and a stage sends its hidden states to the rank `tp_size` further on.
The driver is the last stage's tensor rank 0: it samples, so sampled tokens start where the scheduler is.
A context with both sizes 1 is the single-process case: every collective is a no-op.

This module sits below the runner, beside the other plain types: the model layers import it. What creates the
contexts of a parallel run (launch, the driver, its workers) is `framework.executor`, above the runner.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

MAX_MESSAGE_BYTES = 1 << 30  # a driver command above this is refused before allocating for it
MAX_ERROR_BYTES = 4096  # a start-up error message is cut to this many UTF-8 bytes


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place and process groups; passed to the model and the runner, never stored globally."""

    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: Optional[Any] = None  # torch.distributed ProcessGroup of this stage's tensor ranks
    device_group: Optional[Any] = None  # all ranks, on the step's backend (nccl on GPUs, gloo on CPUs)
    cpu_group: Optional[Any] = None  # all ranks, gloo: the driver's encoded commands (no timeout while idle)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def driver_rank(self) -> int:
        return (self.pp_size - 1) * self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    # ---- tensor parallel -------------------------------------------------------------------------------
    def tp_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over this stage's tensor ranks (in place); identity without tensor parallelism."""
        if self.tp_size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.tp_group)
        return x

    def tp_all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each tensor rank -> [..., tp_size * n], rank 0's part first."""
        if self.tp_size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = torch.empty((self.tp_size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
        gather(parts, x, group=self.tp_group)  # ranks stacked along dim 0
        return torch.movedim(parts.view(self.tp_size, *x.shape), 0, -2).reshape(*x.shape[:-1], -1)

    # ---- pipeline parallel -----------------------------------------------------------------------------
    def send_to_next_stage(self, hidden: torch.Tensor) -> None:
        """Hand this stage's output [T, hidden] to the same tensor rank of the next stage."""
        import torch.distributed as dist

        dist.send(hidden.contiguous(), self.rank + self.tp_size, group=self.device_group)

    def recv_from_previous_stage(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The previous stage's output; every rank knows its shape from the broadcast scheduler output."""
        import torch.distributed as dist

        hidden = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(hidden, self.rank - self.tp_size, group=self.device_group)
        return hidden

    # ---- the driver's results --------------------------------------------------------------------------
    def broadcast_sampled(self, tokens: torch.Tensor, num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank gets the driver's ([R, K+1] int64 tokens, [R] accepted drafts) so all advance the same way.

        One device-side broadcast of a packed [R, K+2] int64 tensor: no host synchronisation.
        """
        if self.world_size == 1:
            return tokens, num_accepted
        import torch.distributed as dist

        packed = torch.cat([tokens.to(torch.int64), num_accepted.to(torch.int64).unsqueeze(1)], dim=1)
        dist.broadcast(packed, self.driver_rank, group=self.device_group)
        return packed[:, :-1], packed[:, -1].to(num_accepted.dtype)

    def broadcast_bytes(self, data: Optional[bytes] = None, timeout: Optional[timedelta] = None) -> bytes:
        """Driver: send `data` to every rank. Others: wait for the driver's bytes and return them.

        Two gloo broadcasts (length, then the bytes as uint8): no pickle, so a receiver gets bytes, never objects.
        `timeout` bounds this call alone (the group's own limit is an idle engine's, days): a gloo send waits
        for the receiver to post its receive, so a rank that died or hangs would otherwise hold the driver.
        """
        import torch.distributed as dist

        def broadcast(tensor: torch.Tensor) -> None:
            if timeout is None:
                dist.broadcast(tensor, src=self.driver_rank, group=self.cpu_group)
                return
            opts = dist.BroadcastOptions()
            opts.rootRank = self.driver_rank  # cpu_group spans every rank in order: group rank = global rank
            opts.timeout = timeout
            self.cpu_group.broadcast([tensor], opts).wait()

        size = torch.tensor([len(data) if self.is_driver and data is not None else 0], dtype=torch.int64)
        broadcast(size)
        n = int(size.item())
        if not 0 <= n <= MAX_MESSAGE_BYTES:
            raise ValueError(f"a message of {n} bytes from the driver is out of range (max {MAX_MESSAGE_BYTES})")
        if self.is_driver:
            buf = torch.frombuffer(bytearray(data or b""), dtype=torch.uint8) if n else torch.zeros(0).byte()
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        if n:
            broadcast(buf)
        return (data or b"") if self.is_driver else buf.numpy().tobytes()

    def meet(self, timeout: timedelta) -> None:
        """Wait until every rank arrives here (a barrier of the host group, bounded by `timeout`).

        Shutdown meets here before the groups are left: a rank that tore its connections down while another still
        read the last message could end that process in an abort at exit (seen once in a while on CPU ranks)."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        opts = dist.BarrierOptions()
        opts.timeout = timeout
        self.cpu_group.barrier(opts).wait()

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` over all ranks (e.g. KV blocks that fit every device)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def gather_errors(self, error: Optional[str]) -> list[str]:
        """Every rank's start-up error (None = fine), so all ranks stop together with the same message.

        UTF-8 text in padded uint8 tensors (an all-gather of lengths, then of the bytes): no pickle.
        """
        if self.world_size == 1:
            return [error] if error else []
        import torch.distributed as dist

        mine = (error or "").encode()[:MAX_ERROR_BYTES]
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(mine)], dtype=torch.int64), group=self.cpu_group)
        width = max(1, max(int(s.item()) for s in sizes))
        padded = torch.tensor(list(mine) + [0] * (width - len(mine)), dtype=torch.uint8)
        bufs = [torch.zeros(width, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, padded, group=self.cpu_group)
        texts = [bytes(b[: int(s.item())].tolist()).decode(errors="replace") for b, s in zip(bufs, sizes)]
        return [f"rank {r}: {e}" for r, e in enumerate(texts) if e]


def stage_layers(num_layers: int, pp_rank: int, pp_size: int) -> range:
    """Layers of one pipeline stage: consecutive, as even as possible, earlier stages take the remainder."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))
