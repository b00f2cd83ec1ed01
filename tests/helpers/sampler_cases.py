"""A sampler over hand-made slots (no model): per-slot params, prompts and outputs, a fake token history."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Optional, Sequence

import numpy as np
import torch

from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import NewRequestData
from samplers.logits_processors import LogitsProcessor
from samplers.sampler import Sampler
from samplers.states import SamplingStates


@dataclass
class Slot:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)  # produced before this step (resumed prefill includes it)
    seed: int = 0


def make_history(num_slots: int, max_len: int, device: str = "cpu", num_draft: int = 0) -> SimpleNamespace:
    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.int32, device=device)

    return SimpleNamespace(
        all_token_ids=zeros(num_slots, max_len),
        prompt_len=zeros(num_slots),
        prefill_len=zeros(num_slots),
        total_len=zeros(num_slots),
        draft_tokens=zeros(num_slots, num_draft),
    )


def make_sampler(
    slots: Sequence[Optional[Slot]],  # index = req_slot; None = free slot
    vocab_size: int,
    *,
    max_len: int = 64,
    eos_token_id: Optional[int] = None,
    logprobs_mode: str = "raw_logprobs",
    processors: Sequence[LogitsProcessor] = (),
    device: str = "cpu",
    num_draft: int = 0,
) -> tuple[Sampler, SimpleNamespace]:
    """A `Sampler` whose slots hold `slots`, with the history as the runner would have written it (and room
    for `num_draft` drafts per slot in `history.draft_tokens`)."""
    history = make_history(len(slots), max_len, device, num_draft)
    states = SamplingStates(
        len(slots),
        torch.device(device),
        vocab_size=vocab_size,
        history=history,
        num_computed_host=lambda: np.zeros(len(slots), dtype=np.int64),
        eos_token_id=eos_token_id,
        logits_processors=processors,
    )
    for req_slot, slot in enumerate(slots):
        if slot is None:
            continue
        tokens = slot.prompt + slot.output
        history.all_token_ids[req_slot, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        history.prompt_len[req_slot] = len(slot.prompt)
        history.prefill_len[req_slot] = len(tokens)
        history.total_len[req_slot] = len(tokens)
        params = slot.params.clone()
        params.resolve_bad_words(None)
        states.add_request(
            req_slot, NewRequestData(f"r{req_slot}", tokens, len(slot.prompt), params, slot.seed, [], len(tokens))
        )
    states.apply_staged_writes()
    return Sampler(states, logprobs_mode), history  # type: ignore[arg-type]


def sample_positions(history: SimpleNamespace, expanded_idx_mapping: torch.Tensor) -> torch.Tensor:
    """[L] int64: each row samples the token right after its slot's history."""
    return history.total_len.long()[expanded_idx_mapping.long()]


def run_edits(
    sampler: Sampler, history: SimpleNamespace, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor
) -> torch.Tensor:
    """Stages 2-7 of the pipeline (masks, bias, penalties, processors) on a copy of `logits`."""
    req_slots = np.unique(expanded_idx_mapping.cpu().numpy())
    stages = sampler.states.stages_for(req_slots)
    return sampler.apply_logits_edits(
        logits.clone(), expanded_idx_mapping, sample_positions(history, expanded_idx_mapping), stages
    )
