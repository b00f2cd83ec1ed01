"""Per-step input preparation and post-update: the semantics every GPU kernel of the runner must match.

Index spaces (see the architecture page): `batch_row` (0..R-1, this step's order), `req_slot` (row of the
persistent state tables), `token` (0..T-1, this step's flattened tokens), `logits_row` (0..L-1, one per token
that gets sampled or verified). These are the PyTorch reference implementations; on a GPU the Triton
kernels of the same names replace them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class PreparedInputs(NamedTuple):
    input_ids: torch.Tensor  # [T] int64: token ids to embed
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    seq_lens: torch.Tensor  # [R] int32: KV length of each row after this step
    logits_indices: torch.Tensor  # [L] int64: token index of each logits row
    expanded_idx_mapping: torch.Tensor  # [L] int32: logits row -> req_slot
    sample_positions: torch.Tensor  # [L] int64: position the sampled token of each logits row will occupy


def token_batch_rows(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """[T] int64: batch_row of each token. `num_tokens` is known on the CPU, so nothing syncs."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    rows = torch.arange(query_lens.numel(), device=query_start_loc.device)
    return torch.repeat_interleave(rows, query_lens, output_size=num_tokens)


def prepare_inputs_reference(
    idx_mapping: torch.Tensor,  # [R] int32: batch_row -> req_slot
    query_start_loc: torch.Tensor,  # [R+1] int32: first token of each row
    cu_num_logits: torch.Tensor,  # [R+1] int32: first logits row of each row (1 + drafts per row)
    num_tokens: int,  # T
    num_logits: int,  # L
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32: prompt/prefill + sampled history per req_slot
    prefill_len: torch.Tensor,  # [S] int32
    num_computed: torch.Tensor,  # [S] int32: tokens whose KV is cached
    last_sampled: torch.Tensor,  # [S] int32
    draft_tokens: torch.Tensor,  # [S, K] int32
) -> PreparedInputs:
    """Build this step's inputs from the slot tables.

    Prefill tokens are gathered from `all_token_ids`; a decoding row (everything before it computed) takes
    `[last_sampled, drafts...]`. Each row gets `1 + num_drafts` logits rows at its last tokens.
    """
    device = idx_mapping.device
    row = token_batch_rows(query_start_loc, num_tokens)  # [T]
    slot = idx_mapping.long()[row]  # [T] req_slot per token
    offset = torch.arange(num_tokens, device=device) - query_start_loc.long()[row]  # [T] index within row
    positions = num_computed.long()[slot] + offset  # [T]

    max_len = all_token_ids.shape[1]
    from_history = all_token_ids[slot, positions.clamp(max=max_len - 1)].long()  # [T]
    is_decode_row = num_computed[idx_mapping.long()] >= prefill_len[idx_mapping.long()]  # [R]
    # In a decoding row, token 0 is the last sampled token and tokens 1.. are the drafts.
    draft_col = (offset - 1).clamp(min=0, max=max(draft_tokens.shape[1] - 1, 0))
    from_sampled = torch.where(
        offset == 0,
        last_sampled.long()[slot],
        draft_tokens.long()[slot, draft_col] if draft_tokens.shape[1] else last_sampled.long()[slot],
    )
    input_ids = torch.where(is_decode_row[row], from_sampled, from_history)

    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [R]
    seq_lens = (num_computed.long()[idx_mapping.long()] + query_lens).int()  # [R]

    logits_rows = token_batch_rows(cu_num_logits, num_logits)  # [L] batch_row of each logits row
    num_logits_per_row = (cu_num_logits[1:] - cu_num_logits[:-1]).long()  # [R]
    # The logits rows of row r cover its last num_logits[r] tokens.
    k = torch.arange(num_logits, device=device) - cu_num_logits.long()[logits_rows]
    logits_indices = query_start_loc.long()[logits_rows + 1] - num_logits_per_row[logits_rows] + k
    expanded_idx_mapping = idx_mapping[logits_rows]
    sample_positions = positions[logits_indices] + 1
    return PreparedInputs(input_ids, positions, seq_lens, logits_indices, expanded_idx_mapping, sample_positions)


def compute_num_sampled_reference(
    idx_mapping: torch.Tensor,  # [R] int32
    seq_lens: torch.Tensor,  # [R] int32
    prefill_len: torch.Tensor,  # [S] int32
    num_accepted: torch.Tensor,  # [R] int32: accepted drafts per row (0 without speculation)
    num_draft: torch.Tensor,  # [R] int32: drafts verified per row
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] num_sampled, [R] num_rejected): a prefill chunk that ends before the prompt does samples nothing."""
    done_prefill = seq_lens >= prefill_len[idx_mapping.long()]
    num_sampled = torch.where(done_prefill, num_accepted + 1, torch.zeros_like(num_accepted))
    num_rejected = torch.where(done_prefill, num_draft - num_accepted, torch.zeros_like(num_draft))
    return num_sampled.int(), num_rejected.int()


def post_update_reference(
    idx_mapping: torch.Tensor,  # [R] int32
    query_lens: torch.Tensor,  # [R] int32: tokens computed per row this step
    sampled: torch.Tensor,  # [R, K+1] int64: sampled tokens per row (first num_sampled valid)
    num_sampled: torch.Tensor,  # [R] int32
    num_rejected: torch.Tensor,  # [R] int32
    all_token_ids: torch.Tensor,  # [S, max_model_len] int32, updated in place
    total_len: torch.Tensor,  # [S] int32, updated in place
    num_computed: torch.Tensor,  # [S] int32, updated in place
    last_sampled: torch.Tensor,  # [S] int32, updated in place
) -> None:
    """Advance every scheduled slot on the device: computed tokens, history, lengths, last sampled token."""
    slots = idx_mapping.long()
    num_computed[slots] += (query_lens - num_rejected).to(num_computed.dtype)
    max_len = all_token_ids.shape[1]
    cols = torch.arange(sampled.shape[1], device=sampled.device)  # [K+1]
    dest = total_len.long()[slots].unsqueeze(1) + cols  # [R, K+1]
    valid = (cols < num_sampled.long().unsqueeze(1)) & (dest < max_len)
    rows2d = slots.unsqueeze(1).expand_as(dest)
    all_token_ids[rows2d[valid], dest[valid]] = sampled[valid].to(all_token_ids.dtype)
    has_token = num_sampled > 0
    last = sampled.gather(1, (num_sampled.long() - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    last_sampled[slots] = torch.where(has_token, last.to(last_sampled.dtype), last_sampled[slots])
    total_len[slots] += num_sampled.to(total_len.dtype)
