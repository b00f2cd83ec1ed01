"""Per-step input preparation and post-update: the semantics every GPU kernel of the runner must match.

Index spaces (see the architecture page): `batch_row` (0..R-1, this step's order), `req_slot` (row of the
persistent state tables), `token` (0..T-1, this step's flattened tokens), `logits_row` (0..L-1, one per token
that gets sampled or verified). These are the PyTorch reference implementations; on a GPU the Triton
kernels of the same names replace them.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from framework.layers.kernels.launch_math import cdiv, next_power_of_2


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


# ---- Triton kernels ------------------------------------------------------------------------------------


@triton.jit
def _prepare_inputs_kernel(
    idx_mapping_ptr,
    query_start_loc_ptr,
    cu_num_logits_ptr,
    all_token_ids_ptr,
    token_stride,
    max_len,
    prefill_len_ptr,
    num_computed_ptr,
    last_sampled_ptr,
    draft_tokens_ptr,
    draft_stride,
    input_ids_ptr,
    positions_ptr,
    token_rows_ptr,
    seq_lens_ptr,
    logits_indices_ptr,
    expanded_idx_mapping_ptr,
    sample_positions_ptr,
    BLOCK: tl.constexpr,
    BLOCK_LOGITS: tl.constexpr,
):
    # One program per batch row: all of the row's tokens, then its logits rows.
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    q_start = tl.load(query_start_loc_ptr + row)
    q_end = tl.load(query_start_loc_ptr + row + 1)
    n = q_end - q_start
    computed = tl.load(num_computed_ptr + slot)
    prefill_len = tl.load(prefill_len_ptr + slot)
    last = tl.load(last_sampled_ptr + slot).to(tl.int64)
    history_row = all_token_ids_ptr + slot * token_stride
    for off in range(0, n, BLOCK):
        j = off + tl.arange(0, BLOCK)
        mask = j < n
        pos = computed + j
        # A row is either all prefill (every position < prefill_len) or decoding (every position >= it).
        from_history = pos < prefill_len
        hist = tl.load(history_row + tl.minimum(pos, max_len - 1), mask=mask & from_history, other=0)
        draft = tl.load(draft_tokens_ptr + slot * draft_stride + (j - 1), mask=mask & (j >= 1) & ~from_history, other=0)
        sampled = tl.where(j == 0, last, draft.to(tl.int64))
        tok = tl.where(from_history, hist.to(tl.int64), sampled)
        tl.store(input_ids_ptr + q_start + j, tok, mask=mask)
        tl.store(positions_ptr + q_start + j, pos.to(tl.int64), mask=mask)
        tl.store(token_rows_ptr + q_start + j, tl.zeros_like(j).to(tl.int64) + row, mask=mask)
    tl.store(seq_lens_ptr + row, computed + n)
    l_start = tl.load(cu_num_logits_ptr + row)
    num_logits = tl.load(cu_num_logits_ptr + row + 1) - l_start
    k = tl.arange(0, BLOCK_LOGITS)
    kmask = k < num_logits
    token = q_end - num_logits + k
    tl.store(logits_indices_ptr + l_start + k, token.to(tl.int64), mask=kmask)
    tl.store(expanded_idx_mapping_ptr + l_start + k, tl.zeros_like(k) + slot.to(tl.int32), mask=kmask)
    tl.store(sample_positions_ptr + l_start + k, (computed + token - q_start + 1).to(tl.int64), mask=kmask)


def prepare_inputs_triton(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_tokens: int,
    num_logits: int,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed: torch.Tensor,
    last_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    max_logits_per_row: int,
) -> tuple[PreparedInputs, torch.Tensor]:
    """Triton version of `prepare_inputs_reference`; also returns token_rows [T] int64.

    `all_token_ids` may live in pinned host memory (the GPU reads it through unified addressing).
    """
    device = idx_mapping.device
    num_rows = idx_mapping.numel()
    input_ids = torch.empty(num_tokens, dtype=torch.int64, device=device)
    positions = torch.empty(num_tokens, dtype=torch.int64, device=device)
    token_rows = torch.empty(num_tokens, dtype=torch.int64, device=device)
    seq_lens = torch.empty(num_rows, dtype=torch.int32, device=device)
    logits_indices = torch.empty(num_logits, dtype=torch.int64, device=device)
    expanded = torch.empty(num_logits, dtype=torch.int32, device=device)
    sample_positions = torch.empty(num_logits, dtype=torch.int64, device=device)
    if num_rows:
        _prepare_inputs_kernel[(num_rows,)](
            idx_mapping,
            query_start_loc,
            cu_num_logits,
            all_token_ids,
            all_token_ids.stride(0),
            all_token_ids.shape[1],
            prefill_len,
            num_computed,
            last_sampled,
            draft_tokens,
            max(draft_tokens.stride(0), 1),
            input_ids,
            positions,
            token_rows,
            seq_lens,
            logits_indices,
            expanded,
            sample_positions,
            BLOCK=256,
            BLOCK_LOGITS=next_power_of_2(max(max_logits_per_row, 1)),
        )
    prepared = PreparedInputs(input_ids, positions, seq_lens, logits_indices, expanded, sample_positions)
    return prepared, token_rows


@triton.jit(do_not_specialize=["num_rows"])  # per-step sizes: no recompiles mid-run
def _num_sampled_kernel(
    idx_mapping_ptr,
    seq_lens_ptr,
    prefill_len_ptr,
    num_accepted_ptr,
    num_draft_ptr,
    num_sampled_ptr,
    num_rejected_ptr,
    num_rows,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_rows
    slot = tl.load(idx_mapping_ptr + rows, mask=mask, other=0)
    done = tl.load(seq_lens_ptr + rows, mask=mask, other=0) >= tl.load(prefill_len_ptr + slot, mask=mask, other=0)
    accepted = tl.load(num_accepted_ptr + rows, mask=mask, other=0)
    drafts = tl.load(num_draft_ptr + rows, mask=mask, other=0)
    tl.store(num_sampled_ptr + rows, tl.where(done, accepted + 1, 0), mask=mask)
    tl.store(num_rejected_ptr + rows, tl.where(done, drafts - accepted, 0), mask=mask)


def compute_num_sampled_triton(
    idx_mapping: torch.Tensor,
    seq_lens: torch.Tensor,
    prefill_len: torch.Tensor,
    num_accepted: torch.Tensor,
    num_draft: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `compute_num_sampled_reference`."""
    n = idx_mapping.numel()
    num_sampled = torch.empty(n, dtype=torch.int32, device=idx_mapping.device)
    num_rejected = torch.empty(n, dtype=torch.int32, device=idx_mapping.device)
    if n:
        _num_sampled_kernel[(cdiv(n, 256),)](
            idx_mapping, seq_lens, prefill_len, num_accepted, num_draft, num_sampled, num_rejected, n, BLOCK=256
        )
    return num_sampled, num_rejected


@triton.jit
def _post_update_kernel(
    idx_mapping_ptr,
    query_lens_ptr,
    sampled_ptr,
    sampled_stride,
    num_sampled_ptr,
    num_rejected_ptr,
    all_token_ids_ptr,
    token_stride,
    max_len,
    total_len_ptr,
    num_computed_ptr,
    last_sampled_ptr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    slot = tl.load(idx_mapping_ptr + row).to(tl.int64)
    n = tl.load(num_sampled_ptr + row)
    computed = tl.load(num_computed_ptr + slot)
    tl.store(num_computed_ptr + slot, computed + tl.load(query_lens_ptr + row) - tl.load(num_rejected_ptr + row))
    total = tl.load(total_len_ptr + slot)
    k = tl.arange(0, BLOCK)
    tokens = tl.load(sampled_ptr + row * sampled_stride + k, mask=k < n, other=0)
    dest = total + k
    tl.store(all_token_ids_ptr + slot * token_stride + dest, tokens.to(tl.int32), mask=(k < n) & (dest < max_len))
    last = tl.sum(tl.where(k == n - 1, tokens, 0), axis=0)
    if n > 0:
        tl.store(last_sampled_ptr + slot, last.to(tl.int32))
    tl.store(total_len_ptr + slot, total + n)


def post_update_triton(
    idx_mapping: torch.Tensor,
    query_lens: torch.Tensor,
    sampled: torch.Tensor,
    num_sampled: torch.Tensor,
    num_rejected: torch.Tensor,
    all_token_ids: torch.Tensor,
    total_len: torch.Tensor,
    num_computed: torch.Tensor,
    last_sampled: torch.Tensor,
) -> None:
    """Triton version of `post_update_reference` (writes sampled tokens into the possibly host-resident history)."""
    n = idx_mapping.numel()
    if n:
        _post_update_kernel[(n,)](
            idx_mapping,
            query_lens,
            sampled,
            sampled.stride(0),
            num_sampled,
            num_rejected,
            all_token_ids,
            all_token_ids.stride(0),
            all_token_ids.shape[1],
            total_len,
            num_computed,
            last_sampled,
            BLOCK=next_power_of_2(sampled.shape[1]),
        )


# ---- dispatch: Triton on CUDA tensors, the reference elsewhere --------------------------------------------


def use_triton(tensor: torch.Tensor, force: Optional[bool] = None) -> bool:
    """Whether the Triton kernels serve this step: on CUDA by default; `force` overrides (tests)."""
    return tensor.is_cuda if force is None else force


def prepare_inputs(
    idx_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    cu_num_logits: torch.Tensor,
    num_tokens: int,
    num_logits: int,
    all_token_ids: torch.Tensor,
    prefill_len: torch.Tensor,
    num_computed: torch.Tensor,
    last_sampled: torch.Tensor,
    draft_tokens: torch.Tensor,
    max_logits_per_row: int,
) -> tuple[PreparedInputs, torch.Tensor]:
    """(PreparedInputs, token_rows [T] int64): Triton on CUDA, the reference elsewhere."""
    if use_triton(idx_mapping):
        return prepare_inputs_triton(
            idx_mapping,
            query_start_loc,
            cu_num_logits,
            num_tokens,
            num_logits,
            all_token_ids,
            prefill_len,
            num_computed,
            last_sampled,
            draft_tokens,
            max_logits_per_row,
        )
    prepared = prepare_inputs_reference(
        idx_mapping,
        query_start_loc,
        cu_num_logits,
        num_tokens,
        num_logits,
        all_token_ids,
        prefill_len,
        num_computed,
        last_sampled,
        draft_tokens,
    )
    return prepared, token_batch_rows(query_start_loc, num_tokens)


def compute_num_sampled(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatching `compute_num_sampled_reference` / `_triton` (same arguments)."""
    fn = compute_num_sampled_triton if use_triton(args[0]) else compute_num_sampled_reference
    return fn(*args)


def post_update(*args: torch.Tensor) -> None:
    """Dispatching `post_update_reference` / `_triton` (same arguments)."""
    fn = post_update_triton if use_triton(args[0]) else post_update_reference
    fn(*args)
