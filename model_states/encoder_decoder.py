"""Encoder-decoder models (Whisper): per-slot cross-attention keys and values, computed once per request.

A request's encoder input arrives with it (`NewRequestData.encoder_input`) in the step that first schedules
it, or resumes it after a preemption (which freed everything it held, so the encoder simply runs again).
`add_request` stages the features; `prepare_inputs` runs the encoder on every staged request of the step in
one batch and writes each one's cross-attention K/V into its req_slot's blocks of `cross_kv`, before the
decoder forward reads them. Every later decode step only reads those blocks.

`cross_kv` is a paged cache whose blocks are owned statically: req_slot `s` owns blocks
`s * blocks_per_slot .. (s + 1) * blocks_per_slot - 1` (no allocator, nothing to free). Cross-attention then
runs on the paged-attention kernels with one row per decoder token: KV length `enc_len`, a single query at
the last position (so causal masking hides nothing), block-table row = the token's slot's blocks.

Decode CUDA graphs: the encoder stays outside (`prepare_graph_step` encodes the step's new requests before
the replay); inside the graph the cross-attention metadata is computed from the graph's static `idx_mapping`,
so every replay reads the current rows' blocks of the persistent cross cache. The cache has one more slot's
blocks (zeros, `graph_dummy_slot`) for padding rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from framework.batch.graph_batch import GraphBatch
from framework.batch.input_batch import InputBatch
from framework.layers.attention import AttentionMetadata
from framework.models.interface import EncoderDecoder
from framework.params.scheduler_output import NewRequestData
from model_states.default import DefaultModelState

CROSS_BLOCK_SIZE = 16  # tokens per block of the cross cache (a power of two, as the attention kernels need)


class EncoderDecoderModelState(DefaultModelState):
    """Owns `cross_kv` [decoder_layers, 2, S * blocks_per_slot, CROSS_BLOCK_SIZE, heads, head_dim] and the encoder.

    The decoder's self-attention uses the paged KV cache and the block tables exactly as a decoder-only model
    (inherited `prepare_attn_metadata`). A reused slot carries nothing of its previous owner: the new owner's
    encoder output overwrites all of the slot's blocks (padding positions past enc_len included) in the step
    that adds it, before any forward reads them; a request without encoder input, as in the start-up
    profiling run, gets zeroed blocks.

    The model must provide `cross_kv_shape()` -> (decoder_layers, 2, enc_len, heads, head_dim) and
    `encode(features [B, mel_bins, frames])` -> `[B, *cross_kv_shape()]`, and its forward must accept
    `cross=CrossAttentionInputs`.
    """

    # Decoder KV depends on the audio (cross-attention feeds every layer's residual stream): blocks with the same
    # decoder tokens but different audio must never be shared, so no prefix caching (until blocks hash the audio).
    supports_prefix_caching = False

    name = "encoder_decoder"

    def __init__(self, model: nn.Module, hf_config: dict[str, Any], max_num_reqs: int, device: torch.device) -> None:
        super().__init__(model, hf_config, max_num_reqs, device)
        if not isinstance(model, EncoderDecoder):
            raise TypeError(
                f"model state 'encoder_decoder' needs an EncoderDecoder model (cross_kv_shape(), encode()); "
                f"{type(model).__name__} is none"
            )
        layers, two, self.enc_len, heads, head_dim = model.cross_kv_shape()
        self.blocks_per_slot = -(-self.enc_len // CROSS_BLOCK_SIZE)
        dtype = next(model.parameters()).dtype
        # + 1 slot: the dummy slot padding rows of decode graphs read (never written: zeros)
        self.cross_kv = torch.zeros(
            (layers, two, (max_num_reqs + 1) * self.blocks_per_slot, CROSS_BLOCK_SIZE, heads, head_dim),
            dtype=dtype,
            device=device,
        )
        self._block_offsets = torch.arange(self.blocks_per_slot, dtype=torch.int32, device=device)  # [nb]
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
        return {"cross": CrossAttentionInputs(self.cross_kv, self._cross_metadata(batch.idx_mapping, batch.token_rows))}

    def prepare_graph_inputs(self, graph: GraphBatch) -> dict[str, Any]:
        """Inside a decode graph: the cross cache, with metadata computed (in the graph) from its idx_mapping."""
        from framework.models.whisper import CrossAttentionInputs

        return {"cross": CrossAttentionInputs(self.cross_kv, self._cross_metadata(graph.idx_mapping, graph.token_rows))}

    def prepare_graph_step(self, batch: InputBatch, graph_rows: int) -> None:
        """The encoder stays outside the graph: this step's new requests are encoded before the replay."""
        if self._staged:
            self._encode_staged()

    def slot_cross_kv(self, req_slot: int) -> torch.Tensor:
        """[decoder_layers, 2, enc_len, heads, head_dim]: the K/V one slot holds (tests, debugging)."""
        blocks = self.cross_kv[:, :, req_slot * self.blocks_per_slot : (req_slot + 1) * self.blocks_per_slot]
        return blocks.flatten(2, 3)[:, :, : self.enc_len]

    def _cross_metadata(self, idx_mapping: torch.Tensor, token_rows: torch.Tensor) -> AttentionMetadata:
        """One attention row per token: its slot's blocks, KV length enc_len, one query (built on the device
        from idx_mapping [R] int32 batch_row -> req_slot and token_rows [T] token -> batch_row)."""
        t, device = token_rows.numel(), self.device
        token_slots = idx_mapping.long()[token_rows]  # [T] req_slot of each token
        tables = (token_slots.unsqueeze(1) * self.blocks_per_slot).int() + self._block_offsets  # [T, nb]
        return AttentionMetadata(
            num_tokens=t,
            num_rows=t,
            query_start_loc=torch.arange(t + 1, dtype=torch.int32, device=device),
            seq_lens=torch.full((t,), self.enc_len, dtype=torch.int32, device=device),
            block_tables=tables,
            kv_slot_mapping=torch.full((t,), -1, dtype=torch.int64, device=device),  # nothing is stored
            block_size=CROSS_BLOCK_SIZE,
            max_query_len=1,
            max_seq_len=self.enc_len,
        )

    def _encode_staged(self) -> None:
        staged, self._staged = self._staged, {}
        nb, pad = self.blocks_per_slot, self.blocks_per_slot * CROSS_BLOCK_SIZE - self.enc_len
        with_features = {slot: f for slot, f in staged.items() if f is not None}
        for slot in staged.keys() - with_features.keys():
            self.cross_kv[:, :, slot * nb : (slot + 1) * nb].zero_()
        if not with_features:
            return
        slots = torch.tensor(list(with_features), dtype=torch.int64)
        blocks = (slots.unsqueeze(1) * nb + torch.arange(nb)).flatten().to(self.device)  # [B * nb]
        features = torch.stack(list(with_features.values())).to(self.device)
        kv = self.model.encode(features).to(self.cross_kv.dtype)  # [B, layers, 2, L, H, D]
        kv = torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, pad))  # [B, layers, 2, nb * bs, H, D]: pad rows zeroed
        b, layers, two, _, heads, head_dim = kv.shape
        kv = kv.view(b, layers, two, nb, CROSS_BLOCK_SIZE, heads, head_dim).permute(1, 2, 0, 3, 4, 5, 6)
        self.cross_kv.index_copy_(2, blocks, kv.reshape(layers, two, b * nb, CROSS_BLOCK_SIZE, heads, head_dim))
        self.num_encoder_runs += len(with_features)
