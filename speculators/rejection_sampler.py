"""Draft verification on the device: greedy and probabilistic rejection sampling, no host sync.

A batch row verifying `d` drafts owns logits rows `cu[r] .. cu[r] + d`: row `cu[r] + j` (j < d) verifies draft
j, row `cu[r] + d` gives the bonus token. The sampler has already drawn one token per logits row from the
processed target distribution p (argmax for greedy rows, Gumbel-max keyed by (seed, position) otherwise).

* **Drafts without probabilities** (q one-hot on the draft, e.g. ngram) and **greedy rows**: draft j is
  accepted iff the sampler's token at its row equals it. For a random row that is exact rejection sampling:
  a draw x ~ p equals the draft with probability p(d) = min(1, p(d)/q(d)), and given x != d it is
  distributed as normalised max(p - q, 0) — so x is also the recovered token.
* **Drafts with probabilities q** (random rows): accept draft j with u < p(d)/q(d), u uniform from the
  stateless hash at (seed, position, `ACCEPT_TOKEN`); on rejection draw the recovered token by Gumbel-max
  over log(max(p - q, 0)) with the same (seed, position) noise as the sampler. The bonus token is the
  sampler's draw at the bonus row.

Either way the row's output is drafts[:a] + [token at row cu + a], where a = leading accepted drafts.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.input_prep import token_batch_rows
from framework.layers.kernels.launch_math import next_power_of_2
from samplers.gumbel import (
    _gumbel_noise,
    _row_key,
    _uniform,
    hash_bits_reference,
    mix32,
    mul32,
    row_keys,
    uniform_from_bits,
)
from samplers.triton_utils import use_triton, vocab_block

# Token id of the acceptance uniform's hash stream: no vocabulary reaches it, so it is independent of the
# Gumbel noise of every real token at the same (seed, position).
ACCEPT_TOKEN = 0x7FFFFFFF


class VerifyOutput(NamedTuple):
    tokens: torch.Tensor  # [R, K+1] int64: accepted drafts, then the recovered or bonus token (rest 0)
    num_accepted: torch.Tensor  # [R] int32: leading drafts accepted per batch row


# ---- combine: leading accepted drafts + one token --------------------------------------------------------


def combine_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    cu_num_logits: torch.Tensor,  # [R+1] int32: first logits row of each batch row
    draft_tokens: torch.Tensor,  # [S, K] int32: drafts being verified, per req_slot
    candidate: torch.Tensor,  # [L] int64: token emitted at a logits row if its draft is rejected (or bonus)
    accepted: Optional[torch.Tensor],  # [L] bool: draft at the logits row accepted; None = candidate == draft
    max_num_draft: int,  # K' >= every row's draft count: width of the output is K'+1
) -> VerifyOutput:
    """Per batch row: a = leading accepted drafts, tokens = drafts[:a] + [candidate[cu + a]]."""
    num_rows = idx_mapping.numel()
    device = idx_mapping.device
    starts = cu_num_logits[:-1].long()  # [R]
    num_draft = (cu_num_logits[1:] - cu_num_logits[:-1]).long() - 1  # [R]
    cols = torch.arange(max_num_draft + 1, device=device)  # [K'+1]
    in_row = cols.unsqueeze(0) < num_draft.unsqueeze(1)  # [R, K'+1]: columns that verify a draft
    logits_row = (starts.unsqueeze(1) + cols).clamp(max=max(candidate.numel() - 1, 0))  # [R, K'+1]
    width = draft_tokens.shape[1]
    drafts = (
        draft_tokens[idx_mapping.long()][:, cols.clamp(max=max(width - 1, 0))].long()
        if width
        else torch.zeros(num_rows, max_num_draft + 1, dtype=torch.long, device=device)
    )
    cand = candidate[logits_row]  # [R, K'+1]
    ok = (cand == drafts) if accepted is None else accepted[logits_row].bool()
    rejected = in_row & ~ok
    first_reject = torch.where(rejected, cols, max_num_draft + 1).amin(dim=1)  # [R]
    num_accepted = torch.minimum(first_reject, num_draft)  # [R]
    a = num_accepted.unsqueeze(1)
    tokens = torch.where(cols < a, drafts, torch.where(cols == a, cand, torch.zeros_like(cand)))
    return VerifyOutput(tokens, num_accepted.int())


@triton.jit
def _combine_kernel(
    idx_mapping_ptr,
    cu_num_logits_ptr,
    draft_tokens_ptr,
    draft_stride,
    candidate_ptr,
    accepted_ptr,
    tokens_ptr,
    tokens_stride,
    num_accepted_ptr,
    HAS_ACCEPTED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per batch row; BLOCK >= K'+1 covers all of its logits rows at once.
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    start = tl.load(cu_num_logits_ptr + row)
    num_draft = tl.load(cu_num_logits_ptr + row + 1) - start - 1
    cols = tl.arange(0, BLOCK)
    in_row = cols < num_draft
    drafts = tl.load(draft_tokens_ptr + slot * draft_stride + cols, mask=in_row, other=0).to(tl.int64)
    cand = tl.load(candidate_ptr + start + cols, mask=cols <= num_draft, other=0)
    if HAS_ACCEPTED:
        ok = tl.load(accepted_ptr + start + cols, mask=in_row, other=0) != 0
    else:
        ok = cand == drafts
    first_reject = tl.min(tl.where(in_row & ~ok, cols, BLOCK), axis=0)
    a = tl.minimum(first_reject, num_draft)
    out = tl.where(cols < a, drafts, tl.where(cols == a, cand, 0))
    tl.store(tokens_ptr + row * tokens_stride + cols, out, mask=cols < tokens_stride)
    tl.store(num_accepted_ptr + row, a.to(tl.int32))


def combine_triton(
    idx_mapping: torch.Tensor,
    cu_num_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    candidate: torch.Tensor,
    accepted: Optional[torch.Tensor],
    max_num_draft: int,
) -> VerifyOutput:
    """Triton version of `combine_reference` (same arguments)."""
    num_rows = idx_mapping.numel()
    tokens = torch.empty(num_rows, max_num_draft + 1, dtype=torch.int64, device=idx_mapping.device)
    num_accepted = torch.empty(num_rows, dtype=torch.int32, device=idx_mapping.device)
    if num_rows:
        acc = accepted.to(torch.int8) if accepted is not None else candidate  # unused pointer when None
        _combine_kernel[(num_rows,)](
            idx_mapping,
            cu_num_logits,
            draft_tokens,
            max(draft_tokens.stride(0), 1),
            candidate.contiguous(),
            acc,
            tokens,
            tokens.stride(0),
            num_accepted,
            HAS_ACCEPTED=accepted is not None,
            BLOCK=next_power_of_2(max_num_draft + 1),
        )
    return VerifyOutput(tokens, num_accepted)


def combine(
    idx_mapping: torch.Tensor,
    cu_num_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    candidate: torch.Tensor,
    accepted: Optional[torch.Tensor],
    max_num_draft: int,
) -> VerifyOutput:
    """`combine_reference` / `combine_triton`: Triton on CUDA, the reference elsewhere."""
    fn = combine_triton if use_triton(candidate) else combine_reference
    return fn(idx_mapping, cu_num_logits, draft_tokens, candidate, accepted, max_num_draft)


# ---- probabilistic drafts: acceptance test and recovered token per logits row ---------------------------


def accept_uniform_reference(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[L] float32 uniform in (0, 1) per logits row: the hash of (seed, position, ACCEPT_TOKEN)."""
    bits = mix32(row_keys(seeds, positions) ^ mul32(torch.full_like(seeds.long(), ACCEPT_TOKEN), 0x85EBCA6B))
    return uniform_from_bits(bits)


def verify_probs_reference(
    logits: torch.Tensor,  # [L, V] float32: processed target logits (temperature, top-k/p, min-p applied)
    sampled: torch.Tensor,  # [L] int64: the sampler's draw per logits row
    draft_tokens: torch.Tensor,  # [S, K] int32
    draft_probs: torch.Tensor,  # [S, K, V] float32: q of each draft position, per req_slot
    expanded_idx_mapping: torch.Tensor,  # [L] int32: logits_row -> req_slot
    draft_col: torch.Tensor,  # [L] int64: draft index each logits row verifies; -1 on bonus rows
    use_q: torch.Tensor,  # [L] bool: verify against q (random rows); else candidate == draft
    seeds: torch.Tensor,  # [L] int64
    positions: torch.Tensor,  # [L] int64: position of the token each logits row samples
) -> tuple[torch.Tensor, torch.Tensor]:
    """([L] bool accepted, [L] int64 candidate) for logits rows verifying drafts with probabilities."""
    slots = expanded_idx_mapping.long()
    col = draft_col.clamp(min=0)
    is_draft = draft_col >= 0
    draft = draft_tokens[slots, col.clamp(max=max(draft_tokens.shape[1] - 1, 0))].long()  # [L]
    p = torch.softmax(logits, dim=-1)  # [L, V]
    q = draft_probs[slots, col.clamp(max=max(draft_probs.shape[1] - 1, 0))]  # [L, V]
    p_d = p.gather(1, draft.unsqueeze(1)).squeeze(1)
    q_d = q.gather(1, draft.unsqueeze(1)).squeeze(1)
    u = accept_uniform_reference(seeds, positions)
    accept_q = u * q_d < p_d  # u < p/q without dividing (q_d = 0 accepts whenever p_d > 0)
    residual = (p - q).clamp(min=0)
    bits = hash_bits_reference(seeds, positions, logits.shape[1])
    gumbel = -torch.log(-torch.log(uniform_from_bits(bits)))
    scores = torch.where(residual > 0, torch.log(residual) + gumbel, float("-inf"))
    recovered = scores.argmax(dim=-1)
    recovered = torch.where(scores.amax(dim=-1) > float("-inf"), recovered, sampled)  # p == q: nothing left
    q_rows = use_q & is_draft
    accepted = torch.where(q_rows, accept_q, sampled == draft) & is_draft
    candidate = torch.where(q_rows, recovered, sampled)
    return accepted, candidate


@triton.jit
def _verify_probs_kernel(
    logits_ptr,
    logits_stride,
    sampled_ptr,
    draft_tokens_ptr,
    draft_stride,
    draft_probs_ptr,
    probs_slot_stride,
    probs_col_stride,
    expanded_idx_mapping_ptr,
    draft_col_ptr,
    use_q_ptr,
    seeds_ptr,
    positions_ptr,
    accepted_ptr,
    candidate_ptr,
    vocab_size,
    BLOCK: tl.constexpr,
):
    # One program per logits row: two passes over the vocabulary (softmax statistics, then the residual draw).
    logits_row = tl.program_id(0).to(tl.int64)
    col = tl.load(draft_col_ptr + logits_row)
    sampled = tl.load(sampled_ptr + logits_row)
    is_draft = col >= 0
    col = tl.maximum(col, 0)
    slot = tl.load(expanded_idx_mapping_ptr + logits_row).to(tl.int64)
    draft = tl.load(draft_tokens_ptr + slot * draft_stride + col, mask=is_draft, other=0).to(tl.int64)
    use_q = (tl.load(use_q_ptr + logits_row) != 0) & is_draft
    accepted = is_draft & (sampled == draft)
    candidate = sampled
    if use_q:
        row_logits = logits_ptr + logits_row * logits_stride
        row_q = draft_probs_ptr + slot * probs_slot_stride + col * probs_col_stride
        m = tl.full([], -float("inf"), tl.float32)
        s = tl.zeros([], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):
            tok = start + tl.arange(0, BLOCK)
            x = tl.load(row_logits + tok, mask=tok < vocab_size, other=-float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        key = _row_key(tl.load(seeds_ptr + logits_row), tl.load(positions_ptr + logits_row))
        best_value = tl.full([], -float("inf"), tl.float32)
        best_token = tl.zeros([], dtype=tl.int64)
        for start in range(0, vocab_size, BLOCK):
            tok = start + tl.arange(0, BLOCK)
            mask = tok < vocab_size
            p = tl.exp(tl.load(row_logits + tok, mask=mask, other=-float("inf")) - m) / s
            q = tl.load(row_q + tok, mask=mask, other=0.0)
            residual = tl.maximum(p - q, 0.0)
            log_residual = tl.log(tl.where(residual > 0, residual, 1.0))
            score = tl.where(mask & (residual > 0), log_residual + _gumbel_noise(key, tok), -float("inf"))
            block_best = tl.max(score, axis=0)
            block_token = tl.argmax(score, axis=0, tie_break_left=True)
            take = block_best > best_value
            best_token = tl.where(take, start + block_token.to(tl.int64), best_token)
            best_value = tl.where(take, block_best, best_value)
        p_d = tl.exp(tl.load(row_logits + draft) - m) / s
        q_d = tl.load(row_q + draft)
        u_acc = _uniform(key, tl.full([], 0x7FFFFFFF, tl.int64))
        accepted = u_acc * q_d < p_d
        candidate = tl.where(best_value > -float("inf"), best_token, sampled)
    tl.store(accepted_ptr + logits_row, accepted.to(tl.int8))
    tl.store(candidate_ptr + logits_row, candidate)


def verify_probs_triton(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    expanded_idx_mapping: torch.Tensor,
    draft_col: torch.Tensor,
    use_q: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `verify_probs_reference` (same arguments and results)."""
    num_logits, vocab_size = logits.shape
    accepted = torch.empty(num_logits, dtype=torch.int8, device=logits.device)
    candidate = torch.empty(num_logits, dtype=torch.int64, device=logits.device)
    if num_logits:
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        probs = draft_probs if draft_probs.stride(2) == 1 else draft_probs.contiguous()
        _verify_probs_kernel[(num_logits,)](
            logits,
            logits.stride(0),
            sampled.contiguous(),
            draft_tokens,
            max(draft_tokens.stride(0), 1),
            probs,
            probs.stride(0),
            probs.stride(1),
            expanded_idx_mapping,
            draft_col.contiguous(),
            use_q.to(torch.int8),
            seeds.long().contiguous(),
            positions.long().contiguous(),
            accepted,
            candidate,
            vocab_size,
            BLOCK=vocab_block(vocab_size),
        )
    return accepted.bool(), candidate


def verify_probs(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_probs_reference` / `verify_probs_triton`: Triton on CUDA, the reference elsewhere."""
    fn = verify_probs_triton if use_triton(args[0]) else verify_probs_reference
    return fn(*args)


# ---- the runner's entry point ----------------------------------------------------------------------------


def draft_columns(cu_num_logits: torch.Tensor, num_logits: int) -> torch.Tensor:
    """[L] int64: index of the draft each logits row verifies, -1 on each row's last (bonus) logits row."""
    rows = token_batch_rows(cu_num_logits, num_logits)  # [L] batch_row of each logits row
    col = torch.arange(num_logits, device=cu_num_logits.device) - cu_num_logits.long()[rows]
    last = cu_num_logits.long()[rows + 1] - 1
    return torch.where(torch.arange(num_logits, device=col.device) == last, -1, col)


def rejection_sample(
    sampled: torch.Tensor,  # [L] int64: the sampler's token per logits row
    idx_mapping: torch.Tensor,  # [R] int32
    cu_num_logits: torch.Tensor,  # [R+1] int32
    draft_tokens: torch.Tensor,  # [S, K] int32: the drafts being verified
    max_num_draft: int,  # largest draft count of the batch (host)
    *,
    processed_logits: Optional[torch.Tensor] = None,  # [L, V] float32, needed with draft_probs
    draft_probs: Optional[torch.Tensor] = None,  # [S, K, V] float32 q per req_slot and draft column
    expanded_idx_mapping: Optional[torch.Tensor] = None,  # [L] int32
    use_q: Optional[torch.Tensor] = None,  # [L] bool: random rows (greedy rows compare with the argmax)
    seeds: Optional[torch.Tensor] = None,  # [L] int64
    positions: Optional[torch.Tensor] = None,  # [L] int64
) -> VerifyOutput:
    """Verify every row's drafts: one-hot q (no `draft_probs`) or the drafts' own q; see the module docstring."""
    if draft_probs is None:
        return combine(idx_mapping, cu_num_logits, draft_tokens, sampled, None, max_num_draft)
    assert processed_logits is not None and expanded_idx_mapping is not None and use_q is not None
    assert seeds is not None and positions is not None
    cols = draft_columns(cu_num_logits, sampled.numel())
    accepted, candidate = verify_probs(
        processed_logits, sampled, draft_tokens, draft_probs, expanded_idx_mapping, cols, use_q, seeds, positions
    )
    return combine(idx_mapping, cu_num_logits, draft_tokens, candidate, accepted, max_num_draft)
