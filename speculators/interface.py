"""The Speculator boundary: draft proposals that stay on the device between steps.

A speculator is built from the registry as `cls(config.speculator, loaded_target, max_num_reqs, device)`
(`framework.runner.plugins.build_speculator`). After each step's post-update the runner hands it one `ProposeInputs`
and writes the returned `Proposal.draft_token_ids` into `RequestState.draft_tokens`; the next step's input
preparation reads them through `idx_mapping` and the rejection sampler verifies them through
`expanded_idx_mapping`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

if TYPE_CHECKING:
    from framework.batch.input_batch import InputBatch
    from framework.batch.request_state import RequestState
    from framework.config.schema import SpeculatorConfig
    from framework.layers.attention import AttentionMetadata
    from framework.models.loaded import LoadedModel
    from framework.params.scheduler_output import NewRequestData


class ProposeInputs(NamedTuple):
    """What a speculator sees after step N's post-update (all device tensors; nothing may sync)."""

    batch: "InputBatch"  # step N's batch (row order, idx_mapping, query_start_loc, positions, ...)
    hidden_states: torch.Tensor  # [T, H]: the target's last hidden states of step N (after the final norm)
    aux_hidden_states: tuple[torch.Tensor, ...]  # [T, H] each: intermediate target layers a method asked for
    sampled_tokens: torch.Tensor  # [R, K+1] int64: tokens each row produced (first num_sampled valid)
    num_sampled: torch.Tensor  # [R] int32: tokens produced per row (0 for a prefill chunk that samples nothing)
    num_rejected: torch.Tensor  # [R] int32: drafts rejected per row (their KV positions are overwritten later)
    request_state: "RequestState"  # history (all_token_ids, total_len, ...) already includes step N's tokens
    num_draft_tokens: int  # k: drafts to propose per row for step N+1 (0 <= k <= num_speculative_tokens)
    # Step N's attention metadata (block tables, KV slots): draft layers write their KV at the same KV slots.
    attn_metadata: Optional["AttentionMetadata"] = None
    # [R] int32: KV positions each row's allocated blocks hold; draft steps never write at or past it.
    kv_capacity: Optional[torch.Tensor] = None


class Proposal(NamedTuple):
    """A speculator's drafts for the next step."""

    draft_token_ids: torch.Tensor  # [R, k] int32 per batch row of step N
    # [R, k, V] float32 draft distributions q for probabilistic verification; None = the drafts are
    # treated as one-hot (q = 1 on the draft token), which is exact for deterministic proposers like ngram.
    draft_probs: Optional[torch.Tensor] = None


class Speculator(ABC):
    """Proposes up to `num_speculative_tokens` drafts per request after each step.

    Per-slot verbs like every state owner (`add_request` / `remove_request` / `apply_staged_writes`), and
    `propose` once per step. A method that runs draft layers with their own paged KV cache declares
    `num_kv_layers`; the runner allocates that many extra layers (same shape as the target's) after its own
    and hands them over with `bind_kv_caches`, and the draft layers use the target's block tables and KV
    slot mapping.
    """

    name: str = "base"

    def __init__(
        self, config: "SpeculatorConfig", loaded: "LoadedModel", max_num_reqs: int, device: torch.device
    ) -> None:
        self.config = config
        self.loaded = loaded
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_num_reqs = max_num_reqs
        self.device = device

    @property
    def num_kv_layers(self) -> int:
        """Paged KV layers the draft model needs in addition to the target's (0 for model-free methods)."""
        return 0

    @property
    def aux_hidden_layer_ids(self) -> tuple[int, ...]:
        """Target layers whose entering hidden states `ProposeInputs.aux_hidden_states` carries (in this order)."""
        return ()

    @property
    def runs_every_step(self) -> bool:
        """True when `propose` must run after every step, also with k = 0 (a draft model keeping its KV)."""
        return self.num_kv_layers > 0

    def capture_cuda_graphs(self, batch_sizes: list[int], block_size: int, max_blocks_per_req: int) -> None:
        """Capture the method's own CUDA graphs (GPU with `runner.cuda_graphs`), after `bind_kv_caches`."""

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Receive the `num_kv_layers` extra KV cache tensors (called after every KV (re)allocation)."""

    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        """A request took `req_slot`."""

    def remove_request(self, req_slot: int) -> None:
        """The request in `req_slot` left."""

    def apply_staged_writes(self) -> None:
        """Apply this step's staged per-slot writes."""

    @abstractmethod
    def propose(self, inputs: ProposeInputs) -> Proposal:
        """Drafts [R, inputs.num_draft_tokens] int32 per batch row (no host sync)."""
