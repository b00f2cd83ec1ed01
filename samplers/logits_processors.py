"""Custom logits processors: third-party per-slot states that edit the logits before temperature.

A processor is a class registered in `framework.config.registry.LOGITS_PROCESSORS` (decorator, lazy string, or an
entry point of group `mrv2.logits_processors`), enabled for a run by name in `sampler.logits_processors`
(the engine looks the names up: `framework.runner.logits_processors`; this package never imports the engine),
and given per-request arguments through `SamplingParams.extra_args` (each processor reads its own keys).
Like every per-slot owner it has add_request / remove_request / apply_staged_writes, plus `is_active`
(a host-side check, so an unused processor costs nothing) and `apply`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import torch

from framework.params.sampling_params import SamplingParams
from samplers.history import TokenHistory


class LogitsContext(NamedTuple):
    """What a processor may read besides the logits, all on the device."""

    expanded_idx_mapping: torch.Tensor  # [L] int32: logits_row -> req_slot
    sample_positions: torch.Tensor  # [L] int64: position of the token each logits row samples
    history: TokenHistory  # per-slot token history (prompt_len, all_token_ids, total_len, drafts)
    # On a GPU `history.all_token_ids` may live in pinned host memory (cache.token_history_on_host): read it
    # from a Triton kernel (unified addressing), not with torch indexing by device tensors.


class LogitsProcessor(ABC):
    """The interface of a custom logits processor; one instance per engine, state indexed by req_slot.

    `apply` must not sync with the host (no `.item()` / `.tolist()`); it returns the new logits and may
    write them in place. Excluded tokens get -inf.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device

    @classmethod
    def validate_params(cls, params: SamplingParams, vocab_size: int) -> None:
        """Raise `InvalidRequestError` if the request's arguments for this processor are wrong (engine side)."""

    @abstractmethod
    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        """A request takes `req_slot`: overwrite everything the slot held."""

    def remove_request(self, req_slot: int) -> None:
        """The request leaves its slot."""

    def apply_staged_writes(self) -> None:
        """Move what `add_request` staged to the device (once per step)."""

    @abstractmethod
    def is_active(self, req_slots: np.ndarray) -> bool:
        """Whether any request in `req_slots` [R] uses this processor (host check, no device sync)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, context: LogitsContext) -> torch.Tensor:
        """[L, V] float32 logits -> [L, V] processed logits."""
