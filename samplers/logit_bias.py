"""logit_bias: per request, a value added to the logits of chosen token ids (before penalties)."""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from framework.params.sampling_params import SamplingParams
from samplers.history import SlotLists
from samplers.triton_utils import small_block, use_triton


class LogitBiasState:
    """Each req_slot's bias as two padded lists: token ids [S+1, W] int32 and values [S+1, W] float32. Row
    `max_num_reqs` (empty: a no-op) serves the padding rows of full-step graphs
    (`framework.runner.graphs.step_graphs`)."""

    def __init__(self, max_num_reqs: int, device: torch.device) -> None:
        self.tokens = SlotLists(max_num_reqs + 1, torch.int32, device)
        self.values = SlotLists(max_num_reqs + 1, torch.float32, device)

    def reserve(self, width: int) -> None:
        """Room for `width` entries per slot now (full-step graphs read the tables at fixed addresses)."""
        self.tokens.reserve(width)
        self.values.reserve(width)

    def add_request(self, req_slot: int, params: SamplingParams) -> None:
        bias = params.logit_bias or {}
        self.tokens.set(req_slot, list(bias.keys()))
        self.values.set(req_slot, [float(v) for v in bias.values()])

    def remove_request(self, req_slot: int) -> None:
        self.tokens.host_lens[req_slot] = 0  # the next owner stages its own list

    def apply_staged_writes(self) -> None:
        self.tokens.apply_staged_writes()
        self.values.apply_staged_writes()

    def any_in(self, req_slots: np.ndarray) -> bool:
        return self.tokens.any_in(req_slots)

    def apply(self, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor) -> torch.Tensor:
        return apply_logit_bias(logits, expanded_idx_mapping, self.tokens.values, self.values.values, self.tokens.lens)


def apply_logit_bias_reference(
    logits: torch.Tensor,  # [L, V] float32
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    bias_tokens: torch.Tensor,  # [S, W] int32: token ids (distinct within a slot)
    bias_values: torch.Tensor,  # [S, W] float32
    bias_lens: torch.Tensor,  # [S] int32: valid entries per slot
) -> torch.Tensor:
    """[L, V]: logits[row, token] += value for each (token, value) of the row's slot."""
    slots = expanded_idx_mapping.long()
    valid = torch.arange(bias_tokens.shape[1], device=logits.device) < bias_lens.long()[slots].unsqueeze(1)
    values = torch.where(valid, bias_values[slots], torch.zeros((), device=logits.device))
    return torch.scatter_add(logits, 1, bias_tokens[slots].long(), values)  # padding adds 0


@triton.jit
def _apply_logit_bias_kernel(
    logits_ptr, logits_stride, idx_ptr, tokens_ptr, values_ptr, lens_ptr, table_stride, BLOCK: tl.constexpr
):
    logits_row = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(idx_ptr + logits_row).to(tl.int64)
    n = tl.load(lens_ptr + req_slot)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tokens = tl.load(tokens_ptr + req_slot * table_stride + offs, mask=mask, other=0)
        values = tl.load(values_ptr + req_slot * table_stride + offs, mask=mask, other=0.0)
        ptrs = logits_ptr + logits_row * logits_stride + tokens
        tl.store(ptrs, tl.load(ptrs, mask=mask) + values, mask=mask)


def apply_logit_bias_triton(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    bias_tokens: torch.Tensor,
    bias_values: torch.Tensor,
    bias_lens: torch.Tensor,
) -> torch.Tensor:
    """In place, same result as `apply_logit_bias_reference` (one program per logits row)."""
    if logits.shape[0]:
        _apply_logit_bias_kernel[(logits.shape[0],)](
            logits,
            logits.stride(0),
            expanded_idx_mapping,
            bias_tokens,
            bias_values,
            bias_lens,
            bias_tokens.stride(0),
            BLOCK=small_block(min(bias_tokens.shape[1], 256)),
        )
    return logits


def apply_logit_bias(
    logits: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    bias_tokens: torch.Tensor,
    bias_values: torch.Tensor,
    bias_lens: torch.Tensor,
) -> torch.Tensor:
    """[L, V] biased logits (Triton on CUDA, writing in place; the reference elsewhere)."""
    fn = apply_logit_bias_triton if use_triton(logits) else apply_logit_bias_reference
    return fn(logits, expanded_idx_mapping, bias_tokens, bias_values, bias_lens)
