"""CUDA graphs for steps with prompt tokens, in pieces: every attention runs eagerly between two replays.

A step with prompt chunks cannot replay one graph: attention's grids follow the batch's rows and lengths. The
rest of a dense decoder layer (norms, projections, q/k norm + RoPE + the KV store, the MLP) depends on the
token count only. So the forward is cut at every attention and each piece is captured once per padded token
count (`runner.prefill_cuda_graph_sizes`):

    piece 0     embedding, RoPE's cos/sin, layer 0 up to its q
    piece i     layer i-1 after attention (o_proj, norm, MLP), layer i up to its q
    piece L     layer L-1 after attention, the final norm -> hidden states

A step copies its tokens into static buffers, replays piece 0, then for each layer runs attention eagerly from
the static q buffer into the static attention buffer (on the step's real metadata) and replays the next piece.
Padding tokens (position 0, KV slot -1) are computed and dropped: their K/V is never stored and no attention
reads them.

Why: an eager 8,192-token step of the 0.6B geometry queues ~290 kernels through Python, 20-33 ms of host time
on the H200 machine's CPU against ~19 ms of kernels (docs/benchmarks.md); the pieces cost 29 replays and 28
attention launches.

Dense decoder layers only (`DecoderLayer`: MoE routing and recurrent layers are not cut this way), one rank, no
draft model (ngram drafts are fine) and a ModelState without extra forward inputs (`unsupported_reason` and
`RunnerGraphs`).
"""

from __future__ import annotations

import bisect
import logging
from typing import Any, Callable, Optional

import torch

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import order_rows_longest_first
from framework.models.llama import DecoderLayer, LlamaForCausalLM
from framework.runner.graphs.cuda_graphs import CudaGraphCapturer, GraphCapturer, Replayable

logger = logging.getLogger(__name__)


def prefill_graph_sizes(configured: list[int], max_num_batched_tokens: int) -> list[int]:
    """The token counts to capture: the configured ones up to the step budget, plus the budget itself."""
    return sorted({s for s in configured if s <= max_num_batched_tokens} | {max_num_batched_tokens})


def unsupported_reason(model: Any) -> Optional[str]:
    """None when `model`'s forward can be cut into pieces at its attentions; otherwise why not."""
    if not isinstance(model, LlamaForCausalLM):
        return f"{type(model).__name__} is not a decoder-only Llama-family model"
    if model.ctx.tp_size > 1 or model.ctx.pp_size > 1:
        return "tensor / pipeline parallelism"
    if model.kv_groups is not None:  # the pieces store K/V through the step's one slot mapping
        return "KV groups (cache.kv_groups)"
    layers = [model.model.layers[i] for i in model.model.stage_layers]
    kinds = {type(layer).__name__ for layer in layers if type(layer) is not DecoderLayer}
    if kinds:
        return f"layers other than dense DecoderLayer ({', '.join(sorted(kinds))})"
    return None


class PrefillPieceGraphs:
    """Static buffers sized for the largest token count, and per size the L + 1 captured pieces."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        sizes: list[int],
        device: torch.device,
        capturer: Optional[GraphCapturer] = None,
    ) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"prefill graph pieces: {reason}")
        self.model = model
        self.layers: list[DecoderLayer] = [model.model.layers[i] for i in model.model.stage_layers]
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self._capturer: GraphCapturer = capturer if capturer is not None else CudaGraphCapturer()
        n, cfg = self.sizes[-1], model.config
        attn = self.layers[0].self_attn
        dtype = model.model.embed_tokens.weight.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [N]
        self.kv_slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)  # [N], padding -1
        self.cos = torch.zeros(n, attn.head_dim, dtype=dtype, device=device)  # [N, head_dim]
        self.sin = torch.zeros_like(self.cos)
        self.residual = torch.zeros(n, cfg.hidden_size, dtype=dtype, device=device)  # [N, hidden]
        self.q = torch.zeros(n, attn.num_heads, attn.head_dim, dtype=dtype, device=device)  # [N, H, D]
        self.attn_out = torch.zeros_like(self.q)  # [N, H, D]: attention's output, the next piece's input
        self.pieces: dict[int, list[Replayable]] = {}
        self.num_replayed_steps = 0

    # ---- capture -----------------------------------------------------------------------------------------
    def _piece(self, size: int, i: int) -> Callable[[], Any]:
        """Piece i of a `size`-token step: reads and writes static buffers only (see the module docstring)."""
        ids, positions, slots = self.input_ids[:size], self.positions[:size], self.kv_slot_mapping[:size]
        cos, sin, residual, q, attn_out = (b[:size] for b in (self.cos, self.sin, self.residual, self.q, self.attn_out))
        layers, kv, model = self.layers, self.kv_caches, self.model

        def up_to_q(layer: int, x: torch.Tensor, res: Optional[torch.Tensor]) -> None:
            q_i, res = layers[layer].before_attention(x, res, cos, sin, kv[layer], slots)
            q.copy_(q_i)
            residual.copy_(res)

        def first() -> None:
            c, s = model.rope_cos_sin(positions, cos.dtype)
            cos.copy_(c)
            sin.copy_(s)
            up_to_q(0, model.model.embed_tokens(ids), None)

        def middle() -> None:
            up_to_q(i, *layers[i - 1].after_attention(attn_out, residual))

        def last() -> torch.Tensor:  # [size, hidden]
            return model.model.norm.add_and_norm(*layers[-1].after_attention(attn_out, residual))[0]

        return first if i == 0 else last if i == len(layers) else middle

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size's pieces, largest first (smaller ones reuse its memory pool)."""
        self.kv_slot_mapping.fill_(-1)  # warm-up and capture store no K/V
        for size in reversed(self.sizes):
            self.pieces[size] = [self._capturer.capture(self._piece(size, i)) for i in range(len(self.layers) + 1)]
        self._capturer.finish()
        logger.info(
            "captured prefill graph pieces for token counts %s (%d pieces each)", self.sizes, len(self.layers) + 1
        )

    # ---- per step ----------------------------------------------------------------------------------------
    def padded_size(self, num_tokens: int) -> Optional[int]:
        """Smallest captured token count >= `num_tokens`, or None (the step runs eagerly)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """hidden [T, hidden] of the step's T tokens (`size` = `padded_size(T)`): the forward's result."""
        t = meta.num_tokens
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.positions[t:size].zero_()
        self.kv_slot_mapping[:t].copy_(meta.kv_slot_mapping)
        self.kv_slot_mapping[t:size].fill_(-1)
        model = self.model
        if model.longest_rows_first:  # as the eager forward does: one order shared by every layer
            meta = order_rows_longest_first(meta)
        pieces = self.pieces[size]
        waits = meta.kv_waits  # piece i stores layer i's K/V: it waits for that layer's loads (KV connector)
        waits.layer(0)
        pieces[0].replay()
        for i, kv_cache in enumerate(self.kv_caches):
            attn = self.layers[i].self_attn
            model.attention(self.q[:t], kv_cache, meta, attn.scale, window=attn.window, out=self.attn_out)
            if i + 1 < len(self.kv_caches):
                waits.layer(i + 1)
            hidden = pieces[i + 1].replay()
        self.num_replayed_steps += 1
        return hidden[:t]
