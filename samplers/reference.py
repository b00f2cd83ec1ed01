"""Steps 8-12 of the sampler in PyTorch: the one reference every sampling path of V1 and V2 must match.

`sample_reference` is what the fused Triton path (`samplers.fused_sampling.sample_fused_triton`) returns token
for token, and what both runners run on the CPU. Its pieces serve the sampler's separate stages too
(`samplers.sampler.Sampler`, when the processed logits are wanted): `processed_logits` (temperature, top-k /
top-p, min-p) and `pick_tokens` (argmax for greedy rows, Gumbel-max with (seed, position) noise otherwise)
dispatch to the unfused Triton kernels on CUDA unless asked for the reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from samplers.gumbel import gumbel_sample, gumbel_sample_reference
from samplers.sanitize import sanitize_logits_reference
from samplers.top_k_top_p import apply_min_p, apply_min_p_reference, apply_top_k_top_p, apply_top_k_top_p_reference


class SlotSamplingParams(NamedTuple):
    """The per-request-slot parameter tables ([S] each), read through `expanded_idx_mapping`."""

    temperature: torch.Tensor  # [S] float32, 0 = greedy
    top_k: torch.Tensor  # [S] int32, <= 0 or >= V = off
    top_p: torch.Tensor  # [S] float32, >= 1 = off
    min_p: torch.Tensor  # [S] float32, 0 = off
    seed: torch.Tensor  # [S] int64


class RowParams(NamedTuple):
    """Per logits row, the scalar parameters of its request (greedy rows get the filters switched off)."""

    is_greedy: torch.Tensor  # [L] bool
    temperature: torch.Tensor  # [L] float32, 1.0 on greedy rows
    top_k: torch.Tensor  # [L] int32, 0 on greedy rows
    top_p: torch.Tensor  # [L] float32, 1.0 on greedy rows
    min_p: torch.Tensor  # [L] float32, 0.0 on greedy rows
    seed: torch.Tensor  # [L] int64


class FusedSample(NamedTuple):
    sampled: torch.Tensor  # [L] int64
    errors: torch.Tensor  # [L] int32: 0, `nonfinite_code` or `no_token_code`


def row_params(params: SlotSamplingParams, expanded_idx_mapping: torch.Tensor) -> RowParams:
    """Each logits row's parameters, gathered by req_slot ([L] int32 `expanded_idx_mapping`)."""
    slots = expanded_idx_mapping.long()
    temperature = params.temperature[slots]
    greedy = temperature == 0
    return RowParams(
        is_greedy=greedy,
        temperature=torch.where(greedy, 1.0, temperature),
        top_k=torch.where(greedy, 0, params.top_k[slots]),
        top_p=torch.where(greedy, 1.0, params.top_p[slots]),
        min_p=torch.where(greedy, 0.0, params.min_p[slots]),
        seed=params.seed[slots],
    )


def processed_logits(
    logits: torch.Tensor,  # [L, V] float32, sanitized (no NaN / +inf)
    row: RowParams,
    *,
    top_k_top_p: bool = True,
    min_p: bool = True,
    reference: bool = False,
) -> torch.Tensor:
    """Steps 8-10: [L, V] y = logits / T with top-k / top-p, then min-p, masked to -inf (greedy rows: the
    logits). `top_k_top_p` / `min_p` False skip a stage no row uses; `reference` keeps the unfused Triton
    kernels out (which write the new tensor in place)."""
    y = logits / row.temperature.unsqueeze(1)
    if top_k_top_p:
        y = (apply_top_k_top_p_reference if reference else apply_top_k_top_p)(y, row.top_k, row.top_p)
    if min_p:
        y = (apply_min_p_reference if reference else apply_min_p)(y, row.min_p)
    return y


def pick_tokens(
    processed: torch.Tensor,  # [L, V] float32 from `processed_logits`
    row: RowParams,
    positions: torch.Tensor,  # [L] int64: position of the token being sampled
    reference: bool = False,
) -> torch.Tensor:
    """Step 11: [L] int64, the argmax on greedy rows, Gumbel-max with (seed, position) noise on the others."""
    gumbel = (gumbel_sample_reference if reference else gumbel_sample)(processed, row.seed, positions)
    return torch.where(row.is_greedy, processed.argmax(dim=-1), gumbel)


def row_errors(
    processed: torch.Tensor,  # [L, V] float32 the tokens were drawn from
    sampled: torch.Tensor,  # [L] int64
    nonfinite: torch.Tensor,  # [L] bool: the row had NaN / +inf logits
    nonfinite_code: int,
    no_token_code: int,
) -> torch.Tensor:
    """Step 12: [L] int32, 0, `nonfinite_code`, or `no_token_code` when the chosen token is excluded (-inf)."""
    no_token = processed.gather(1, sampled.unsqueeze(1)).squeeze(1) == float("-inf")
    return torch.where(nonfinite, nonfinite_code, torch.where(no_token, no_token_code, 0)).int()


def sample_reference(
    logits: torch.Tensor,  # [L, V] float32 (NaN/+inf allowed: treated as -inf and flagged)
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    positions: torch.Tensor,  # [L] int64: position of the token being sampled
    params: SlotSamplingParams,
    nonfinite_code: int = 1,
    no_token_code: int = 2,
    *,
    any_random: bool = True,
    any_filter: bool = True,
) -> FusedSample:
    """Steps 1 and 8-12 in PyTorch, on a sanitized copy: temperature, top-k, top-p, min-p, then Gumbel-max
    (greedy rows: argmax), every error flagged. `any_random=False` (every row greedy) and `any_filter=False`
    (no row uses top-k, top-p or min-p) skip stages that would change nothing, as the host mirrors tell."""
    logits, nonfinite = sanitize_logits_reference(logits.float().clone())
    if not any_random:
        sampled = logits.argmax(dim=-1)
        return FusedSample(sampled, row_errors(logits, sampled, nonfinite, nonfinite_code, no_token_code))
    row = row_params(params, expanded_idx_mapping)
    y = processed_logits(logits, row, top_k_top_p=any_filter, min_p=any_filter, reference=True)
    sampled = pick_tokens(y, row, positions, reference=True)
    return FusedSample(sampled, row_errors(y, sampled, nonfinite, nonfinite_code, no_token_code))
