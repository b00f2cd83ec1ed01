"""LoRA per request slot: which GPU adapter slot each request slot uses, and the adapters in those slots.

`LoraState` is a per-slot owner like the others (`add_request` / `remove_request` / `apply_staged_writes`, and
`prepare` for the step): a request's adapter takes a GPU slot when the request takes its request slot, and the
step's token -> adapter map is written before the forward. `LoraSlots` keeps `lora.max_loras` GPU slots and up
to `lora.max_cpu_loras` CPU copies; an adapter no request holds is evicted least recently used first. The
scheduler admits a request only while the adapters of the running requests fit the GPU slots, so a slot is
always free here.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Union

import numpy as np
import torch
from torch import nn

from framework.batch.host_staging import HostRing
from framework.config.lora import LoraConfig
from framework.config.schema import ConfigError, Mrv2Config
from framework.models.loaded import LoadedModel
from framework.models.lora.adapter import LoraAdapter, read_adapter
from framework.models.lora.projection import LoraGroup, LoraTokens, attach_lora, lora_targets
from framework.models.small_batch import enable_small_batch
from framework.params.lora_request import LoRARequest
from framework.params.scheduler_output import NewRequestData, SchedulerOutput


class LoraSlots:
    """GPU adapter slots with reference counts and LRU eviction, and the CPU copies they are filled from."""

    def __init__(self, config: LoraConfig, model: nn.Module, groups: list[LoraGroup]) -> None:
        self.config, self.groups = config, groups
        self.targets = lora_targets(model)
        self.names: list[Optional[LoRARequest]] = [None] * config.max_loras  # GPU slot -> adapter
        self.users = [0] * config.max_loras  # request slots using each GPU slot
        self.lru: OrderedDict[int, None] = OrderedDict((i, None) for i in range(config.max_loras))  # oldest first
        self.cpu: OrderedDict[LoRARequest, LoraAdapter] = OrderedDict()
        self.loads = 0  # adapters written into a GPU slot (tests count evictions with it)

    def acquire(self, lora: LoRARequest) -> int:
        """The GPU slot holding `lora` (loaded now if needed, into a free slot or the least recently used one
        that no request uses); one more user of it."""
        if lora in self.names:
            slot = self.names.index(lora)
        else:
            idle = [s for s in self.lru if self.users[s] == 0]
            if not idle:
                raise RuntimeError(f"no free LoRA slot for '{lora.name}' (lora.max_loras={self.config.max_loras})")
            slot = idle[0]
            adapter = self._cpu_copy(lora)
            for group in self.groups:
                group.load(slot, adapter)
            self.names[slot] = lora
            self.loads += 1
        self.users[slot] += 1
        self.lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1

    def _cpu_copy(self, lora: LoRARequest) -> LoraAdapter:
        adapter = self.cpu.pop(lora, None)
        if adapter is None:
            adapter = read_adapter(lora, self.targets, self.config.max_rank)
        self.cpu[lora] = adapter  # most recent last
        while len(self.cpu) > (self.config.max_cpu_loras or self.config.max_loras):
            self.cpu.popitem(last=False)
        return adapter


class LoraState:
    """Per request slot: the GPU adapter slot of its adapter (-1: none). Before each forward, `prepare` writes
    `LoraTokens.token_lora` (every token of the step: its row's adapter; the rest -1) and the same tokens grouped by
    adapter (`LoraTokens.stage`) with one host-to-device copy, so decode graphs, full-step graphs and prefill pieces
    read them from fixed addresses."""

    def __init__(
        self,
        config: LoraConfig,
        model: nn.Module,
        max_reqs: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.tokens = LoraTokens(max_tokens, config.max_loras, device)
        enable_small_batch(model, 0)  # the one-row GEMV path has no LoRA hook: one-row forwards take the GEMMs
        self.groups = attach_lora(model, config.max_loras, config.max_rank, self.tokens, dtype, device)
        self.slots = LoraSlots(config, model, self.groups)
        self.slot_lora = np.full(max_reqs + 1, -1, dtype=np.int32)  # req_slot -> GPU slot (+1: the dummy slot)
        self._staged: dict[int, int] = {}
        self._ring = HostRing(self.tokens.buffer.shape[0], device)
        self._dirty = 0  # token_lora[:_dirty] may hold adapters; everything after it is -1

    def add_request(self, slot: int, new: NewRequestData) -> None:
        self._staged[slot] = self.slots.acquire(new.lora) if new.lora is not None else -1

    def remove_request(self, slot: int) -> None:
        gpu_slot = self._staged.pop(slot, int(self.slot_lora[slot]))
        if gpu_slot >= 0:
            self.slots.release(gpu_slot)
        self.slot_lora[slot] = -1

    def apply_staged_writes(self) -> None:
        for slot, gpu_slot in self._staged.items():
            self.slot_lora[slot] = gpu_slot
        self._staged.clear()

    def prepare(self, output: SchedulerOutput, req_slots: np.ndarray) -> None:
        """Write this step's token -> GPU adapter slot map (`req_slots`: batch_row -> req_slot, host)."""
        rows = self.slot_lora[req_slots]
        if self._dirty == 0 and not (rows >= 0).any():
            return  # no adapter in this step nor in what the buffer holds: nothing to write
        per_token = np.repeat(rows, output.num_scheduled_tokens)
        count = max(len(per_token), self._dirty)
        index, host, array = self._ring.take()
        start, stop = self.tokens.stage(array, per_token, count)
        self.tokens.buffer[start:stop].copy_(host[start:stop], non_blocking=True)
        self._ring.sent(index)
        self._dirty = len(per_token) if (rows >= 0).any() else 0


class NoLora:
    """`LoraState`'s verbs doing nothing: the runner's owner when `lora.enable` is off (no branch in the step)."""

    def add_request(self, slot: int, new: NewRequestData) -> None:
        pass

    def remove_request(self, slot: int) -> None:
        pass

    def apply_staged_writes(self) -> None:
        pass

    def prepare(self, output: SchedulerOutput, req_slots: np.ndarray) -> None:
        pass


def build_lora_state(config: Mrv2Config, loaded: LoadedModel) -> Union[LoraState, NoLora]:
    """The runner's `LoraState` (`lora.enable`; else a `NoLora`); its token map covers the largest step any forward
    or graph runs."""
    if not config.lora.enable:
        return NoLora()
    if loaded.parallel.tp_size > 1 or loaded.parallel.pp_size > 1:
        raise ConfigError("lora.enable: LoRA adapters do not run under tensor or pipeline parallelism yet")
    if not getattr(loaded.model, "supports_lora", True):
        raise ConfigError(f"lora.enable: {type(loaded.model).__name__} does not take LoRA adapters yet")
    runner = config.runner
    per_row = config.speculator.num_speculative_tokens + 1
    max_tokens = max(
        [config.scheduler.max_num_batched_tokens, *runner.prefill_cuda_graph_sizes]
        + [size * per_row for size in runner.cuda_graph_sizes]
    )
    max_reqs = config.scheduler.max_num_seqs
    return LoraState(config.lora, loaded.model, max_reqs, max_tokens, loaded.dtype, loaded.device)
