"""EAGLE (EAGLE-1) draft head: fc over [token embedding, target hidden], then one decoder layer.

Checkpoint layout (as the public yuhuili/EAGLE-* checkpoints), `config.json` = the target family's config with
`num_hidden_layers: 1` (architectures e.g. `EagleQwen3ForCausalLM`, `EagleLlamaForCausalLM` or plain
`LlamaForCausalLM`):

| tensor | shape | |
|---|---|---|
| `fc.weight` | [H, 2H] | over `cat(embed(token), hidden)`, embedding first |
| `fc.bias` | [H] | optional |
| `layers.0.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, post_attention_layernorm}.*` | | one decoder layer of the family (Qwen3: also `self_attn.{q,k}_norm`) |
| `layers.0.input_layernorm.weight` | [H] | optional: absent in EAGLE-1 (the fc output enters the layer unnormalised) |
| `embed_tokens.weight`, `lm_head.weight` | [vocab, H] | optional; otherwise the target's are shared |

Logits: `lm_head(h)` with no norm in between, as EAGLE-1 does. The head is trained to predict the target's
*final* (post-norm) hidden state of the next position, the same tensor it reads as input, so its output is
already in the space the LM head expects; its own output is fed back as the hidden state of later steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.layers import Attend, HeadDecoderLayer, decoder_config, family_of


class EagleHead(DraftHead):
    """EAGLE-1 head. `fc_bias`, `input_norm`, `own_embed`, `own_lm_head` say which optional tensors exist."""

    kind = "eagle"

    def __init__(
        self,
        config: dict[str, Any],
        *,
        fc_bias: bool = False,
        input_norm: bool = False,
        own_embed: bool = False,
        own_lm_head: bool = False,
    ) -> None:
        family = family_of((config.get("architectures") or [""])[0])
        if family is None:
            raise ValueError(
                f"EAGLE config architectures={config.get('architectures')!r} names no supported family "
                "(Llama, Mistral, Qwen2, Qwen3), e.g. 'EagleQwen3ForCausalLM'"
            )
        cfg = decoder_config({**config, "num_hidden_layers": 1}, family)
        super().__init__(config, cfg)
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList([HeadDecoderLayer(cfg, input_norm=input_norm)])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False) if own_lm_head else None

    @classmethod
    def from_tensor_names(cls, config: dict[str, Any], names: set[str]) -> "EagleHead":
        """The head whose optional tensors are those present in `names`."""
        return cls(
            config,
            fc_bias="fc.bias" in names,
            input_norm="layers.0.input_layernorm.weight" in names,
            own_embed="embed_tokens.weight" in names,
            own_lm_head="lm_head.weight" in names,
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
        embeds = nn.functional.embedding(input_ids, self._weight(self.embed_tokens, "embed_tokens")).to(hidden.dtype)
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        return self.layers[0](x, cos, sin, attend)

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return nn.functional.linear(hidden, self._weight(self.lm_head, "lm_head")).float()
