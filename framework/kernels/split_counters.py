"""Zeroed counters that split kernels share across launches (the split-KV attention, the split-K GEMM)."""

from __future__ import annotations

from typing import Optional

import torch


class SplitCounters:
    """Zeroed int32 counters for kernels whose last program of a group finishes the group's work (the split-KV
    decode attention, the split-K GEMM), one buffer per device, kept for the owner's life.

    Such a kernel counts finished splits per group (a batch row and KV head, an output tile) and the last one
    resets its counter, so a buffer zeroed once stays zero between launches: every layer, step and CUDA-graph
    replay reuses it. A buffer is allocated outside graph capture only (zeroed inside one, it would be zero
    only once replayed); an outgrown one is kept, since a captured graph may still point at it.
    """

    MIN_SLOTS = 4096  # 16 KB: more groups than any split launch of attention or the GEMM has

    def __init__(self) -> None:
        self._buffers: dict[torch.device, torch.Tensor] = {}  # [slots] int32 per device
        self._outgrown: list[torch.Tensor] = []

    def get(self, device: torch.device, num_slots: int) -> Optional[torch.Tensor]:
        """[>= num_slots] int32 zeros on `device`; None while a CUDA graph is captured and none is big enough."""
        buf = self._buffers.get(device)
        if buf is not None and buf.numel() >= num_slots:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None  # the kernel wrapper then zeroes a buffer of its own, inside the graph
        if buf is not None:
            self._outgrown.append(buf)
        buf = torch.zeros(max(num_slots, self.MIN_SLOTS), dtype=torch.int32, device=device)
        self._buffers[device] = buf
        return buf
