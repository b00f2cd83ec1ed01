"""Per-request-slot sampling state, written when a request joins and read through an index mapping.

`SamplingStates` owns one state object per kind of parameter and forwards the per-slot verbs to each;
`stages_for` tells, from host mirrors only, which stages this step's batch needs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from framework.batch.staged_writes import StagedWrites
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import NewRequestData
from samplers.allowed_tokens import AllowedTokensState
from samplers.bad_words import BadWordsState
from samplers.history import TokenHistory
from samplers.logit_bias import LogitBiasState
from samplers.logits_processors import LogitsProcessor
from samplers.min_tokens import MinTokensState
from samplers.penalties import PenaltiesState
from samplers.prompt_logprobs import PromptLogprobsState
from samplers.reference import RowParams, SlotSamplingParams, row_params
from samplers.structured.state import StructuredOutputsState
from samplers.thinking_budget import ThinkingBudgetState


@dataclass(frozen=True)
class SamplingStages:
    """Which sampler stages this step's batch needs (a stage no request uses is skipped)."""

    any_random: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool
    any_allowed_tokens: bool = False
    any_bad_words: bool = False
    any_min_tokens: bool = False
    any_thinking_budget: bool = False
    any_logit_bias: bool = False
    any_penalties: bool = False
    processors: tuple[int, ...] = ()  # indices of the custom processors some request uses
    any_structured: bool = False  # a grammar constrains some row (its bitmask is applied first)
    num_logprobs: int = -1  # largest `logprobs` in the batch; -1 = nobody asked
    all_gather: bool = False  # every request random with top-k < vocab or top-p < 1 (the fused sampler's gather rows)

    @property
    def any_logits_edit(self) -> bool:
        """Whether any stage before temperature changes the logits."""
        return (
            self.any_allowed_tokens
            or self.any_bad_words
            or self.any_min_tokens
            or self.any_thinking_budget
            or self.any_logit_bias
            or self.any_penalties
            or bool(self.processors)
        )

    @property
    def any_logits_read(self) -> bool:
        """Whether any stage before temperature reads or changes the logits (logprobs, the grammar bitmask, the
        edits): those stages run float32 arithmetic, so the sampler gives them a float32 copy of the logits."""
        return self.num_logprobs >= 0 or self.any_structured or self.any_logits_edit


MIN_TEMPERATURE = 1e-5  # below this a request is greedy (dividing by it would overflow the logits)
MAX_TOP_K = (1 << 31) - 1  # the int32 table's largest value; any top_k at or above the vocabulary keeps every token


class SamplingParamsState:
    """temperature / top_k / top_p / min_p / seed per req_slot, on the device, with host mirrors.

    One row more than there are slots: row `max_num_reqs`, all zeros (greedy), is the parameters of the padding
    rows of full-step graphs (`framework.runner.graphs.step_graphs`); no request ever takes it."""

    FIELDS = {
        "temperature": torch.float32,
        "top_k": torch.int32,
        "top_p": torch.float32,
        "min_p": torch.float32,
        "seed": torch.int64,
    }

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.tensors = {n: torch.zeros(max_num_reqs + 1, dtype=dt, device=device) for n, dt in self.FIELDS.items()}
        self.host = {
            n: np.zeros(max_num_reqs + 1, dtype=torch.empty(0, dtype=dt).numpy().dtype) for n, dt in self.FIELDS.items()
        }
        self._staged = {n: StagedWrites(t) for n, t in self.tensors.items()}

    def add_request(self, req_slot: int, params: SamplingParams, seed: int) -> None:
        values = {
            "temperature": params.temperature if params.temperature >= MIN_TEMPERATURE else 0.0,
            "top_k": min(params.top_k, MAX_TOP_K) if params.top_k > 0 else 0,
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

    @property
    def slot_params(self) -> SlotSamplingParams:
        """The device tables, as the samplers' functions take them."""
        return SlotSamplingParams(**self.tensors)

    def gather(self, expanded_idx_mapping: torch.Tensor) -> RowParams:
        return row_params(self.slot_params, expanded_idx_mapping)

    def stages_for(self, req_slots: np.ndarray, vocab_size: int) -> SamplingStages:
        """The stages 8-11 that the requests in `req_slots` need, from the host mirrors (no device sync); the
        other fields stay off."""
        host = self.host
        random = host["temperature"][req_slots] > 0
        top_k = random & (host["top_k"][req_slots] > 0)
        top_p = random & (host["top_p"][req_slots] < 1.0)
        return SamplingStages(
            any_random=bool(random.any()),
            any_top_k=bool(top_k.any()),
            any_top_p=bool(top_p.any()),
            any_min_p=bool((random & (host["min_p"][req_slots] > 0)).any()),
            all_gather=bool(len(req_slots)) and bool(((top_k & (host["top_k"][req_slots] < vocab_size)) | top_p).all()),
        )


class SamplingStates:
    """Every per-slot sampling state of the runner, behind the usual verbs.

    Adding a request overwrites every field of its slot in every state, so a reused slot keeps nothing of
    its last owner. `history` is the runner's `RequestState` (token history on the device);
    `num_computed_host` returns its host mirror of computed tokens (used to size prompt logprobs).
    """

    def __init__(
        self,
        max_num_reqs: int,
        device: torch.device,
        *,
        vocab_size: int,
        history: TokenHistory,
        num_computed_host: Callable[[], np.ndarray],
        eos_token_id: Optional[int] = None,
        logits_processors: Sequence[LogitsProcessor] = (),
        structured: Optional[StructuredOutputsState] = None,
    ) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self.params = SamplingParamsState(max_num_reqs, device)
        self.allowed_tokens = AllowedTokensState(max_num_reqs, vocab_size, device)
        self.bad_words = BadWordsState(max_num_reqs, device, history)
        self.min_tokens = MinTokensState(max_num_reqs, device, history, eos_token_id)
        self.thinking_budget = ThinkingBudgetState(max_num_reqs, device, history)
        self.logit_bias = LogitBiasState(max_num_reqs, device)
        self.penalties = PenaltiesState(max_num_reqs, vocab_size, device, history)
        self.prompt_logprobs = PromptLogprobsState(max_num_reqs, num_computed_host)
        self.processors = list(logits_processors)
        self.structured = structured  # grammar matchers (structured outputs); None: requests may not ask for them
        self.history = history
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # host only: -1 = no logprobs

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The scalar parameters by name ([S] each)."""
        return self.params.tensors

    def _param_states(self) -> list:
        return [
            self.allowed_tokens,
            self.bad_words,
            self.min_tokens,
            self.thinking_budget,
            self.logit_bias,
            self.penalties,
        ]

    def add_request(self, req_slot: int, new: NewRequestData) -> None:
        params = new.sampling_params
        self.params.add_request(req_slot, params, new.sampling_seed)
        for state in self._param_states() + self.processors:
            state.add_request(req_slot, params)
        self.prompt_logprobs.add_request(req_slot, new)
        if self.structured is not None:
            self.structured.add_request(req_slot, new)
        self.num_logprobs[req_slot] = -1 if params.logprobs is None else params.logprobs

    def remove_request(self, req_slot: int) -> None:
        self.num_logprobs[req_slot] = -1
        for state in [self.params, *self._param_states(), self.prompt_logprobs, *self.processors]:
            state.remove_request(req_slot)
        if self.structured is not None:
            self.structured.remove_request(req_slot)

    def apply_staged_writes(self) -> None:
        for state in [self.params, *self._param_states(), *self.processors]:
            state.apply_staged_writes()

    def stages_for(self, req_slots: np.ndarray) -> SamplingStages:
        """Stages needed by the requests in `req_slots` (host-side check, no device sync)."""
        return dataclasses.replace(
            self.params.stages_for(req_slots, self.vocab_size),
            any_allowed_tokens=self.allowed_tokens.any_in(req_slots),
            any_bad_words=self.bad_words.any_in(req_slots),
            any_min_tokens=self.min_tokens.any_in(req_slots),
            any_thinking_budget=self.thinking_budget.any_in(req_slots),
            any_logit_bias=self.logit_bias.any_in(req_slots),
            any_penalties=self.penalties.any_in(req_slots),
            processors=tuple(i for i, p in enumerate(self.processors) if p.is_active(req_slots)),
            any_structured=self.structured is not None and self.structured.any_in(req_slots),
            num_logprobs=int(self.num_logprobs[req_slots].max()) if len(req_slots) else -1,
        )

    def record_sampled(
        self,
        idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
        sampled: torch.Tensor,  # [R, K+1] int64
        num_sampled: torch.Tensor,  # [R] int32
    ) -> None:
        """Post-update on the device: the penalty counts advance by this step's tokens."""
        self.penalties.record_sampled(idx_mapping, sampled, num_sampled)
