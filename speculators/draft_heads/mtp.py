"""MTP (DeepSeek-V3-style multi-token prediction) draft head on a Llama / Qwen family target.

Checkpoint layout: the target's `config.json` with `num_nextn_predict_layers: n` (>= 1), and for each MTP
layer i (key index N = the target's `num_hidden_layers` + i), in the target checkpoint itself or in a
separate directory with the same keys:

| tensor | shape | |
|---|---|---|
| `model.layers.{N}.enorm.weight` | [H] | RMSNorm of the token embedding |
| `model.layers.{N}.hnorm.weight` | [H] | RMSNorm of the previous hidden state |
| `model.layers.{N}.eh_proj.weight` | [H, 2H] | over `cat(enorm(embed(token)), hnorm(hidden))`, embedding first |
| `model.layers.{N}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}` | | a decoder block of the target family |
| `model.layers.{N}.shared_head.norm.weight` | [H] | norm before the LM head |
| `model.layers.{N}.shared_head.head.weight` | [vocab, H] | optional; otherwise the target's LM head |
| `model.layers.{N}.embed_tokens.weight` | [vocab, H] | optional; otherwise the target's embedding |

Draft step s uses layer `s % n` (one layer applied k times when k > n). Logits are
`head(shared_head.norm(h))`; the pre-norm output h is the hidden state of the next step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from framework.models.llama import RMSNorm
from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.layers import Attend, HeadDecoderLayer, decoder_config, family_of


class SharedHead(nn.Module):
    """`shared_head.norm` and, when the checkpoint has one, `shared_head.head`."""

    def __init__(self, hidden_size: int, vocab_size: int, eps: float, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False) if own_head else None


class MTPLayer(HeadDecoderLayer):
    """One MTP module: enorm, hnorm, eh_proj, then a decoder block of the family, and its shared head."""

    def __init__(self, cfg: Any, own_embed: bool, own_head: bool) -> None:
        super().__init__(cfg, input_norm=True)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.shared_head = SharedHead(h, cfg.vocab_size, cfg.rms_norm_eps, own_head)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None


class _Layers(nn.Module):
    """`model.layers.{N}` naming of the checkpoint."""

    def __init__(self, layers: dict[str, MTPLayer]) -> None:
        super().__init__()
        self.layers = nn.ModuleDict(layers)


def num_mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


class MTPHead(DraftHead):
    """MTP layers `model.layers.{L + i}`; `own_embed` / `own_head` hold per layer index i."""

    kind = "mtp"

    def __init__(
        self, config: dict[str, Any], *, own_embed: Optional[list[bool]] = None, own_head: Optional[list[bool]] = None
    ) -> None:
        family = family_of((config.get("architectures") or [""])[0])
        if family is None:
            raise ValueError(
                f"MTP config architectures={config.get('architectures')!r} names no supported family "
                "(Llama, Mistral, Qwen2, Qwen3)"
            )
        n = num_mtp_layers(config)
        if n < 1:
            raise ValueError("MTP config.json needs num_nextn_predict_layers >= 1")
        cfg = decoder_config(config, family)
        super().__init__(config, cfg)
        self.first_layer_index = cfg.num_layers
        self.num_layers = n
        own_embed = own_embed or [False] * n
        own_head = own_head or [False] * n
        self.model = _Layers({str(cfg.num_layers + i): MTPLayer(cfg, own_embed[i], own_head[i]) for i in range(n)})

    @classmethod
    def from_tensor_names(cls, config: dict[str, Any], names: set[str]) -> "MTPHead":
        first, n = int(config["num_hidden_layers"]), num_mtp_layers(config)
        prefix = [f"model.layers.{first + i}." for i in range(n)]
        return cls(
            config,
            own_embed=[p + "embed_tokens.weight" in names for p in prefix],
            own_head=[p + "shared_head.head.weight" in names for p in prefix],
        )

    def layer(self, step: int) -> MTPLayer:
        return self.model.layers[str(self.first_layer_index + step % self.num_layers)]  # type: ignore[return-value]

    def _run(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        step: int,
    ) -> torch.Tensor:
        layer = self.layer(step)
        embeds = nn.functional.embedding(input_ids, self._weight(layer.embed_tokens, "embed_tokens")).to(hidden.dtype)
        x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(hidden)], dim=-1))
        return HeadDecoderLayer.forward(layer, x, cos, sin, attend)

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        layer = self.layer(step)
        head = self._weight(layer.shared_head.head, "lm_head")
        return nn.functional.linear(layer.shared_head.norm(hidden), head).float()
