"""What every draft head shares: its config, RoPE, the target weights it may borrow, the two forwards, saving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.parallel.linear import StackedPart
from framework.models.hf_config import DecoderConfig
from framework.models.interface import paged_kv_shape
from speculators.draft_heads.layers import Attend, causal_attend, paged_attend, rope_cos_sin


class DraftHead(nn.Module):
    """A draft model that maps (token id, previous hidden state) at each position to a new hidden state.

    Row p of a draft sequence reads the token at position p + 1 and a hidden state of position p (the
    target's on the first pass, the head's own output afterwards), and runs at position p: its output
    predicts the token at p + 2. Callers do the shift.

    Forwards (same weights, same arithmetic):
    - `forward(input_ids [B, N], hidden [B, N, H_in], positions=None, step=0) -> [B, N, H]`: whole sequences,
      dense causal attention, no cache (training, test references).
    - `forward_paged(input_ids [T], hidden [T, H_in], positions [T], kv_cache, meta, step=0) -> [T, H]`:
      flattened tokens on the paged KV cache layer `kv_cache` (the speculator).
    `step` selects the layer of a multi-layer head (MTP: layer `step % num_layers`); others ignore it.

    Weights the checkpoint does not hold (embedding, LM head) are borrowed from the target with
    `share_target_weights`; they are plain attributes, never in `state_dict`, so saving writes only the head.
    """

    kind: ClassVar[str] = "base"
    # Its linear layers are column- / row-parallel ones and its experts `StackedExperts`, so a quantized checkpoint's
    # methods can replace them (`load_draft_head`); a head without it refuses quantized weights.
    supports_quantization: ClassVar[bool] = False

    def __init__(self, config: dict[str, Any], layer_config: DecoderConfig) -> None:
        super().__init__()
        self.config = dict(config)
        self.layer_config = layer_config
        self.hidden_size = layer_config.hidden_size
        self.vocab_size = layer_config.vocab_size
        self.register_buffer("inv_freq", layer_config.rope_inv_freq(), persistent=False)
        self._shared: dict[str, torch.Tensor] = {}
        self.kernel_backend = "auto"  # kernels.backend, the target's (set_kernel_backend)

    def init_buffers(self) -> None:
        """Recompute the buffers from the config (after a build on the meta device, which holds no values;
        `framework.models.materialise`). Subclasses with buffers of their own extend it."""
        self.inv_freq = self.layer_config.rope_inv_freq()

    # ---- weights borrowed from the target -----------------------------------------------------------------
    def share_target_weights(self, embed_tokens: Optional[torch.Tensor], lm_head: Optional[torch.Tensor]) -> None:
        """Borrow the target's embedding [vocab, H] and LM head [vocab, H] for what the head does not own."""
        for name, weight in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if weight is None:
                continue
            if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
                raise ValueError(
                    f"target {name} has shape {tuple(weight.shape)}, the {self.kind} head needs "
                    f"({self.vocab_size}, {self.hidden_size})"
                )
            self._shared[name] = weight

    def _weight(self, own: Optional[nn.Module], name: str) -> torch.Tensor:
        if own is not None:
            return own.weight
        if name not in self._shared:
            raise RuntimeError(f"the {self.kind} head has no {name} of its own: call share_target_weights first")
        return self._shared[name]

    # ---- forwards ---------------------------------------------------------------------------------------
    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: Optional[torch.Tensor] = None, step: int = 0
    ) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        return self._run(input_ids, hidden, cos, sin, causal_attend(self.layer_config.head_dim**-0.5), step)

    def forward_paged(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        step: int = 0,
    ) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.inv_freq, hidden.dtype)
        return self._run(
            input_ids,
            hidden,
            cos,
            sin,
            paged_attend(kv_cache, meta, self.layer_config.head_dim**-0.5, self.kernel_backend),
            step,
        )

    def _run(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        step: int,
    ) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[..., H] -> [..., vocab] float32 logits over the target vocabulary."""
        raise NotImplementedError

    def draft_token_ids(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """[..., H] -> [...] int64 greedy draft tokens (target vocabulary ids)."""
        return self.compute_logits(hidden, step).argmax(-1)

    # ---- geometry the engine asks for ------------------------------------------------------------------
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of the head's paged KV cache layer (the target's block layout: the runner checks they match)."""
        return paged_kv_shape(num_blocks, block_size, self.layer_config.num_kv_heads, self.layer_config.head_dim)

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """Where checkpoint tensor `name` goes when not simply into the parameter of its name (a MoE block's
        experts, stacked into one parameter per projection); None for every tensor of a head without experts."""
        return None

    def aux_layer_ids(self, target_num_layers: int) -> Optional[tuple[int, ...]]:
        """Target layers whose input hidden states the head reads (None: the target's final hidden state)."""
        return None

    # ---- saving -----------------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path) -> None:
        """Write `config.json` and `model.safetensors` (the head's own tensors only) to directory `path`."""
        from safetensors.torch import save_file

        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        (root / "config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
        tensors = {name: t.detach().contiguous().cpu() for name, t in self.state_dict().items()}
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
