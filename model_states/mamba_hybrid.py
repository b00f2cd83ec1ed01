"""Mamba-hybrid models: per-slot conv and SSM state beside the paged KV cache of the attention layers.

Each request slot owns, for every Mamba layer, a conv state (the last `d_conv - 1` conv inputs) and an SSM
state (`d_inner x d_state`, float32). They are allocated with the slot tables at start-up and zeroed when a
request takes the slot, so a reused slot carries nothing of its previous owner. The forward advances them in
place: a prefill chunk scans from the slot's state (chunked prefill continues where the last chunk
stopped), a pure decode batch takes the one-step update.

Preemption frees the KV blocks and recomputes the request from its first token; its recurrent state cannot
be recovered from anything kept, so the resumed request (a new `add_request`) starts from a zeroed slot.

Speculative decoding: a row verifying drafts runs `1 + k` tokens, but its state must advance only by the
tokens that were accepted. When a step has drafts, `prepare_inputs` hands every Mamba layer tail buffers in
which the kernels store the state after each of a row's last `K + 1` tokens; `postprocess` copies, for every
row, the one after `query_len - num_rejected` tokens into the slot, on the device, with no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from framework.models.mamba_layer import MambaLayerState, MambaStepInputs
from model_states.default import DefaultModelState

if TYPE_CHECKING:
    from framework.input_batch import InputBatch
    from framework.scheduler_output import NewRequestData


class MambaHybridModelState(DefaultModelState):
    """Paged attention metadata (as the default state) plus per-slot Mamba conv and SSM state.

    The model must offer `mamba_state_shapes()` -> (number of Mamba layers, per-slot conv state shape,
    per-slot SSM state shape) and accept the `mamba` forward input (`MambaStepInputs`).
    """

    decode_cuda_graphs = False  # extra per-slot inputs each step: decode runs eagerly

    name = "mamba_hybrid"
    supports_prefix_caching = False  # no Mamba state is kept for cached prefixes (yet): see add_request

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, hf_config, max_num_reqs, device)
        shapes = getattr(model, "mamba_state_shapes", None)
        if shapes is None:
            raise TypeError(f"model state 'mamba_hybrid' needs a model with mamba_state_shapes(); "
                            f"{type(model).__name__} has none")
        num_layers, conv_shape, ssm_shape = shapes()
        conv_dtype = next(model.parameters()).dtype
        # [L, S, d_inner, d_conv-1] and [L, S, d_inner, d_state]: one slab per kind, a layer's view is [S, ...].
        self.conv_state = torch.zeros(num_layers, max_num_reqs, *conv_shape, dtype=conv_dtype, device=device)
        self.ssm_state = torch.zeros(num_layers, max_num_reqs, *ssm_shape, dtype=torch.float32, device=device)
        self._slots_to_reset: list[int] = []
        self._tails: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # this step's, when it has drafts

    # ---- per-slot verbs ------------------------------------------------------------------------------------
    def add_request(self, req_slot: int, request: "NewRequestData") -> None:
        if request.num_computed_tokens:
            # A recurrent state exists only for tokens this slot ran; a cached prefix would skip them.
            raise NotImplementedError(
                f"request '{request.request_id}' arrives with {request.num_computed_tokens} computed tokens (a "
                "prefix-cache hit): Mamba-hybrid models keep no state for cached prefixes; disable prefix caching")
        self._slots_to_reset.append(req_slot)

    def remove_request(self, req_slot: int) -> None:
        """Nothing to free: the slot's rows are zeroed when the next request takes it."""

    def apply_staged_writes(self) -> None:
        """Zero the state of every slot a request took since the last step (one fill per state slab)."""
        if not self._slots_to_reset:
            return
        slots = torch.tensor(self._slots_to_reset, dtype=torch.int64).to(self.device, non_blocking=True)
        self.conv_state.index_fill_(1, slots, 0)
        self.ssm_state.index_fill_(1, slots, 0)
        self._slots_to_reset.clear()

    # ---- step hooks --------------------------------------------------------------------------------------
    def prepare_inputs(self, batch: "InputBatch") -> dict[str, Any]:
        """The `mamba` forward input: each layer's state views, and tail buffers when the step has drafts."""
        num_tail = int(batch.num_draft_host.max()) + 1 if batch.num_rows else 1
        self._tails = None
        if num_tail > 1:
            r = batch.num_rows
            self._tails = (
                torch.empty(self.conv_state.shape[0], r, num_tail, *self.conv_state.shape[2:],
                            dtype=self.conv_state.dtype, device=self.device),
                torch.empty(self.ssm_state.shape[0], r, num_tail, *self.ssm_state.shape[2:],
                            dtype=torch.float32, device=self.device),
            )
        layers = [
            MambaLayerState(self.conv_state[i], self.ssm_state[i],
                            self._tails[0][i] if self._tails else None, self._tails[1][i] if self._tails else None)
            for i in range(self.conv_state.shape[0])
        ]
        pure_decode = batch.num_tokens == batch.num_rows
        return {"mamba": MambaStepInputs(layers, batch.idx_mapping, batch.query_start_loc, pure_decode)}

    def postprocess(self, batch: "InputBatch", num_sampled: torch.Tensor, num_rejected: torch.Tensor) -> None:
        """With drafts: keep, per row, the state after its accepted tokens (`query_len - num_rejected`)."""
        if self._tails is None:
            return  # without drafts every token a row ran is accepted: the forward already advanced the slots
        conv_tail, ssm_tail = self._tails
        self._tails = None
        num_tail = ssm_tail.shape[2]
        rows = torch.arange(batch.num_rows, device=self.device)
        keep = (num_tail - 1 - num_rejected.long()).clamp(min=0)  # tail index after the last accepted token
        slots = batch.idx_mapping.long()
        self.conv_state[:, slots] = conv_tail[:, rows, keep]
        self.ssm_state[:, slots] = ssm_tail[:, rows, keep]
