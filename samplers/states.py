"""Per-request-slot sampling parameters, written when a request joins and read through an index mapping."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from framework.sampling_params import SamplingParams
from framework.staged_writes import StagedWrites


@dataclass(frozen=True)
class SamplingStages:
    """Which sampler stages this step's batch needs (a stage no request uses is skipped)."""

    any_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool


class SamplingStates:
    """temperature / top_k / top_p / min_p / seed per req_slot, on the device, with host mirrors.

    The host mirrors answer "does any request in this batch need stage X" without touching the device.
    Adding a request overwrites every field of its slot, so a reused slot keeps nothing of its last owner.
    """

    FIELDS = {"temperature": torch.float32, "top_k": torch.int32, "top_p": torch.float32,
              "min_p": torch.float32, "seed": torch.int64}

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.device = device
        self.tensors = {n: torch.zeros(max_num_reqs, dtype=dt, device=device) for n, dt in self.FIELDS.items()}
        self.host = {n: np.zeros(max_num_reqs, dtype=torch.empty(0, dtype=dt).numpy().dtype)
                     for n, dt in self.FIELDS.items()}
        self._staged = {n: StagedWrites(t) for n, t in self.tensors.items()}

    def add_request(self, req_slot: int, params: SamplingParams, seed: int) -> None:
        values = {
            "temperature": params.temperature,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "seed": seed,
        }
        for name, value in values.items():
            self.host[name][req_slot] = value
            self._staged[name].stage(req_slot, value)

    def remove_request(self, req_slot: int) -> None:
        """Nothing to clear: the next owner of the slot overwrites every field."""

    def apply_staged_writes(self) -> None:
        for staged in self._staged.values():
            staged.apply()

    def stages_for(self, req_slots: np.ndarray) -> SamplingStages:
        """Stages needed by the requests in `req_slots` (host-side check, no device sync)."""
        random = self.host["temperature"][req_slots] > 0
        return SamplingStages(
            any_random=bool(random.any()),
            any_top_k=bool((random & (self.host["top_k"][req_slots] > 0)).any()),
            any_top_p=bool((random & (self.host["top_p"][req_slots] < 1.0)).any()),
            any_min_p=bool((random & (self.host["min_p"][req_slots] > 0)).any()),
        )
