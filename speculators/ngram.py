"""ngram (prompt lookup) drafts, computed on the device from each request's own token history.

For the request in slot s with history h = all_token_ids[s, :total_len[s]] (its newest tokens included):
find the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens of h also occur
earlier, ending at some index e < len(h) - 1; among matches of that length take the latest e. The drafts
are h[e+1 : e+1+k]; positions past the end of h (and every draft of a row without a match) repeat the last
token of h. Those drafts are wrong more often than not, but verification makes any draft safe: the row
simply accepts fewer, and the speculator never needs the host to know whether it matched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from framework.layers.kernels.input_prep import use_triton
from framework.layers.kernels.launch_math import next_power_of_2
from speculators.interface import Proposal, ProposeInputs, Speculator


def ngram_propose_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32: token history per req_slot
    total_len: torch.Tensor,  # [S] int32: valid history entries per req_slot
    num_draft: int,  # k
    min_n: int,
    max_n: int,
) -> torch.Tensor:
    """[R, k] int32 drafts per batch row (see the module docstring)."""
    slots = idx_mapping.long()
    device = idx_mapping.device
    history = all_token_ids[slots.cpu()].to(device).long()  # [R, W] (a host-resident history is gathered)
    width = history.shape[1]
    total = total_len.long()[slots]  # [R]
    rows = torch.arange(slots.numel(), device=device)
    last_index = (total - 1).clamp(min=0)
    ends = torch.arange(width, device=device)  # [W] candidate end index e
    length = torch.zeros(slots.numel(), width, dtype=torch.long, device=device)  # [R, W] match length, capped
    alive = torch.ones_like(length, dtype=torch.bool)
    for t in range(max_n):
        suffix_t = history[rows, (total - 1 - t).clamp(min=0)]  # [R]
        back = ends - t
        token = history[:, back.clamp(min=0)]  # [R, W]
        alive &= (back >= 0).unsqueeze(0) & (token == suffix_t.unsqueeze(1)) & ((total - 1 - t) >= 0).unsqueeze(1)
        length += alive.long()
    candidate = ends.unsqueeze(0) < (total - 1).unsqueeze(1)  # [R, W]: a token follows the match
    score = torch.where(candidate & (length >= min_n), length * width + ends, -1)
    best = score.amax(dim=1)  # [R]
    matched = best >= 0
    match_end = torch.where(matched, best % width, 0)
    cols = torch.arange(num_draft, device=device)
    src = match_end.unsqueeze(1) + 1 + cols  # [R, k]
    last = history[rows, last_index]  # [R]
    take = matched.unsqueeze(1) & (src < total.unsqueeze(1))
    drafts = torch.where(take, history.gather(1, src.clamp(max=width - 1)), last.unsqueeze(1))
    return drafts.int()


@triton.jit
def _ngram_propose_kernel(
    idx_mapping_ptr,
    all_token_ids_ptr,
    token_stride,
    total_len_ptr,
    drafts_ptr,
    drafts_stride,
    num_draft,
    MIN_N: tl.constexpr,
    MAX_N: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # One program per batch row: a sweep over candidate end indices in blocks, match lengths up to MAX_N.
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    history = all_token_ids_ptr + slot * token_stride
    total = tl.load(total_len_ptr + slot).to(tl.int64)
    last = tl.load(history + tl.maximum(total - 1, 0))
    best = tl.full([], -1, tl.int64)
    for start in range(0, total - 1, BLOCK):
        ends = start + tl.arange(0, BLOCK).to(tl.int64)
        candidate = ends < total - 1
        alive = candidate
        length = tl.zeros([BLOCK], dtype=tl.int64)
        for t in tl.static_range(MAX_N):
            suffix_t = tl.load(history + tl.maximum(total - 1 - t, 0))
            back = ends - t
            token = tl.load(history + back, mask=alive & (back >= 0), other=-1)
            # back >= 0 also implies the suffix has a token t (ends < total - 1).
            alive = alive & (back >= 0) & (token == suffix_t)
            length += alive.to(tl.int64)
        # token_stride (the history width) orders scores by length first, then by the latest end index.
        score = tl.where(candidate & (length >= MIN_N), length * token_stride + ends, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    cols = tl.arange(0, BLOCK_K)
    best_v = tl.zeros([BLOCK_K], dtype=tl.int64) + best  # per column, so every mask below is a vector
    matched = best_v >= 0
    src = tl.where(matched, best_v % token_stride, 0) + 1 + cols
    take = matched & (src < total)
    tokens = tl.load(history + src, mask=take & (cols < num_draft), other=0)
    drafts = tl.where(take, tokens, last)
    tl.store(drafts_ptr + row * drafts_stride + cols, drafts.to(tl.int32), mask=cols < num_draft)


def ngram_propose_triton(
    idx_mapping: torch.Tensor,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    num_draft: int,
    min_n: int,
    max_n: int,
) -> torch.Tensor:
    """Triton version of `ngram_propose_reference`; `all_token_ids` may live in pinned host memory (UVA)."""
    num_rows = idx_mapping.numel()
    drafts = torch.empty(num_rows, num_draft, dtype=torch.int32, device=idx_mapping.device)
    if num_rows and num_draft:
        _ngram_propose_kernel[(num_rows,)](
            idx_mapping,
            all_token_ids,
            all_token_ids.stride(0),
            total_len,
            drafts,
            drafts.stride(0),
            num_draft,
            MIN_N=min_n,
            MAX_N=max_n,
            BLOCK=256,
            BLOCK_K=next_power_of_2(num_draft),
        )
    return drafts


def ngram_propose(
    idx_mapping: torch.Tensor,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    num_draft: int,
    min_n: int,
    max_n: int,
) -> torch.Tensor:
    """[R, k] int32 drafts: Triton on CUDA, the reference elsewhere."""
    fn = ngram_propose_triton if use_triton(idx_mapping) else ngram_propose_reference
    return fn(idx_mapping, all_token_ids, total_len, num_draft, min_n, max_n)


class NgramSpeculator(Speculator):
    """Prompt lookup: no model, no per-slot state; everything it reads is `RequestState`'s history."""

    name = "ngram"

    def propose(self, inputs: ProposeInputs) -> Proposal:
        rs = inputs.request_state
        drafts = ngram_propose(
            inputs.batch.idx_mapping,
            rs.all_token_ids,
            rs.total_len,
            inputs.num_draft_tokens,
            self.config.prompt_lookup_min,
            self.config.prompt_lookup_max,
        )
        return Proposal(drafts)
