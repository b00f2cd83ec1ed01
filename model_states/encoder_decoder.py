"""Encoder-decoder models (Whisper): per-slot cross-attention keys and values, computed once per request.

A request's encoder input arrives with it (`NewRequestData.encoder_input`) in the step that first schedules
it, or resumes it after a preemption (which freed everything it held, so the encoder simply runs again).
`add_request` stages the features; `prepare_inputs` runs the encoder on every staged request of the step in
one batch and writes each one's cross-attention K/V into its req_slot row of `cross_kv`, before the decoder
forward reads them. Every later decode step only reads that row, through `idx_mapping`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.input_batch import InputBatch
from framework.scheduler_output import NewRequestData
from model_states.default import DefaultModelState


class EncoderDecoderModelState(DefaultModelState):
    """Owns `cross_kv` [S, decoder_layers, 2, heads, enc_len, head_dim] (model dtype) and the encoder runs.

    The decoder's self-attention uses the paged KV cache and the block tables exactly as a decoder-only model
    (inherited `prepare_attn_metadata`). A reused slot carries nothing of its previous owner: the new owner's
    encoder output overwrites the whole row in the step that adds it, before any forward reads it (a request
    without encoder input, as in the start-up profiling run, gets a zeroed row).

    The model must provide `cross_kv_shape()` and `encode(features [B, mel_bins, frames])`, returning
    `[B, *cross_kv_shape()]`, and its forward must accept `cross=CrossAttentionInputs`.
    """

    name = "encoder_decoder"

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, hf_config, max_num_reqs, device)
        for attr in ("cross_kv_shape", "encode"):
            if not callable(getattr(model, attr, None)):
                raise TypeError(f"model state 'encoder_decoder' needs a model with {attr}(); "
                                f"{type(model).__name__} has none")
        dtype = next(model.parameters()).dtype
        self.cross_kv = torch.zeros((max_num_reqs, *model.cross_kv_shape()), dtype=dtype, device=device)
        self._staged: dict[int, torch.Tensor | None] = {}  # req_slot -> features [mel_bins, frames] (None: zero)
        self.num_encoder_runs = 0  # requests encoded so far (tests count re-encodes after preemption)

    def add_request(self, req_slot: int, request: NewRequestData) -> None:
        encoder_input = request.encoder_input
        self._staged[req_slot] = None if encoder_input is None else encoder_input.features

    def remove_request(self, req_slot: int) -> None:
        self._staged.pop(req_slot, None)  # added and gone before its step ran: nothing to encode

    def prepare_inputs(self, batch: InputBatch) -> dict[str, Any]:
        """Encode this step's new requests into their slots, then hand the decoder what cross-attention reads."""
        from framework.models.whisper import CrossAttentionInputs

        if self._staged:
            self._encode_staged()
        return {"cross": CrossAttentionInputs(self.cross_kv, batch.idx_mapping, batch.token_rows,
                                              batch.query_start_loc, batch.max_query_len)}

    def _encode_staged(self) -> None:
        staged, self._staged = self._staged, {}
        with_features = {slot: f for slot, f in staged.items() if f is not None}
        for slot in staged.keys() - with_features.keys():
            self.cross_kv[slot].zero_()
        if not with_features:
            return
        slots = torch.tensor(list(with_features), dtype=torch.int64, device=self.device)
        features = torch.stack(list(with_features.values())).to(self.device, non_blocking=True)
        self.cross_kv.index_copy_(0, slots, self.model.encode(features).to(self.cross_kv.dtype))
        self.num_encoder_runs += len(with_features)
