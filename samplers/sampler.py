"""The sampling pipeline: one logits row per sampled or verified token, parameters read by req_slot."""

from __future__ import annotations

from typing import NamedTuple

import torch

from samplers.gumbel import gumbel_sample_reference
from samplers.states import SamplingStages, SamplingStates
from samplers.top_k_top_p import apply_min_p_reference, apply_top_k_top_p_reference


class SamplerOutput(NamedTuple):
    sampled_token_ids: torch.Tensor  # [L] int64: one token per logits row


class Sampler:
    """greedy | temperature -> top-k/top-p -> min-p -> Gumbel-max, each stage skipped when unused."""

    def __init__(self, states: SamplingStates) -> None:
        self.states = states

    def __call__(
        self,
        logits: torch.Tensor,  # [L, V] float32
        expanded_idx_mapping: torch.Tensor,  # [L] int32: logits row -> req_slot
        sample_positions: torch.Tensor,  # [L] int64: position of the token being sampled
        stages: SamplingStages,
    ) -> SamplerOutput:
        greedy_ids = torch.argmax(logits, dim=-1)
        if not stages.any_random:
            return SamplerOutput(greedy_ids)
        slots = expanded_idx_mapping.long()
        t = self.states.tensors
        temperature = t["temperature"][slots]
        is_greedy = temperature == 0
        scaled = logits / torch.where(is_greedy, 1.0, temperature).unsqueeze(1)
        if stages.any_top_k or stages.any_top_p:
            scaled = apply_top_k_top_p_reference(scaled, t["top_k"][slots], t["top_p"][slots])
        if stages.any_min_p:
            scaled = apply_min_p_reference(scaled, t["min_p"][slots])
        sampled = gumbel_sample_reference(scaled, t["seed"][slots], sample_positions)
        return SamplerOutput(torch.where(is_greedy, greedy_ids, sampled))
