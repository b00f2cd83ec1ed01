"""EAGLE-3 draft head: fc over three target layers' hidden states, one "midlayer" over [embedding, hidden].

Checkpoint layout (as the public yuhuili/EAGLE3-* checkpoints), `config.json` with `architectures` e.g.
`LlamaForCausalLMEagle3`, the draft layer's geometry, `vocab_size` (the target's) and `draft_vocab_size`:

| tensor | shape | |
|---|---|---|
| `fc.weight` | [H, 3H] | over `cat(aux_0, aux_1, aux_2)`, the target's hidden states entering layers `aux_layer_ids` |
| `midlayer.input_layernorm.weight` | [H] | normalises the token embedding |
| `midlayer.hidden_norm.weight` | [H] | normalises the hidden state |
| `midlayer.self_attn.{q,k,v}_proj.weight` | [heads*D, 2H] | over `cat(input_layernorm(embed), hidden_norm(hidden))` |
| `midlayer.self_attn.o_proj.weight` | [H, heads*D] | |
| `midlayer.post_attention_layernorm.weight`, `midlayer.mlp.{gate,up,down}_proj.weight` | | |
| `norm.weight` | [H] | final norm before the LM head |
| `lm_head.weight` | [draft_vocab, H] | |
| `d2t` | [draft_vocab] int64 | target id = draft id + d2t[draft id]; optional when draft_vocab == vocab |
| `t2d` | [vocab] bool | which target ids the draft vocabulary holds; optional |
| `embed_tokens.weight` | [vocab, H] | optional; otherwise the target's embedding is shared |

The residual stream of the midlayer is the (projected) hidden state; the head's own pre-norm output is fed
back as the hidden state of later draft steps (it has width H, so fc is skipped for it).
Aux layers: `eagle_aux_hidden_state_layer_ids` in config.json (top level or under `eagle_config`), default
`(2, L // 2, L - 3)` for an L-layer target; layer i's hidden state is the residual stream entering layer i.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from framework.models.llama import MLP, RMSNorm
from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.layers import Attend, HeadAttention, decoder_config, family_of


class Eagle3MidLayer(nn.Module):
    """The EAGLE-3 decoder layer: attention reads [normed embedding, normed hidden] (2H wide)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = HeadAttention(cfg, 2 * h, cfg.qk_norm)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        both = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = hidden + self.self_attn(both, cos, sin, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


def aux_layer_ids_of(config: dict[str, Any]) -> Optional[tuple[int, ...]]:
    """Aux layer ids named by an EAGLE-3 config.json, or None for the default."""
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else tuple(int(i) for i in ids)


class Eagle3Head(DraftHead):
    """EAGLE-3 head; `own_embed` says whether the checkpoint holds `embed_tokens.weight`."""

    kind = "eagle3"

    def __init__(self, config: dict[str, Any], *, own_embed: bool = False) -> None:
        family = family_of((config.get("architectures") or ["LlamaForCausalLMEagle3"])[0]) or "Llama"
        cfg = decoder_config({**config, "num_hidden_layers": 1}, family)
        super().__init__(config, cfg)
        h = cfg.hidden_size
        self.draft_vocab_size = int(config.get("draft_vocab_size") or cfg.vocab_size)
        if not 1 <= self.draft_vocab_size <= cfg.vocab_size:
            raise ValueError(
                f"EAGLE-3 draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={cfg.vocab_size}]"
            )
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3MidLayer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embed else None
        d2t, t2d = self._identity_vocab_maps()
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)

    def _identity_vocab_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t [draft_vocab] int64 zero offsets, t2d [vocab] bool marking the first draft_vocab target ids): the
        maps of a head whose draft vocabulary is the target's first ids (a checkpoint's d2t / t2d replace them)."""
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[: self.draft_vocab_size] = True
        return torch.zeros(self.draft_vocab_size, dtype=torch.int64), t2d

    def init_buffers(self) -> None:
        super().init_buffers()
        self.d2t, self.t2d = self._identity_vocab_maps()

    @classmethod
    def from_tensor_names(cls, config: dict[str, Any], names: set[str]) -> "Eagle3Head":
        return cls(config, own_embed="embed_tokens.weight" in names)

    def aux_layer_ids(self, target_num_layers: int) -> tuple[int, ...]:
        ids = aux_layer_ids_of(self.config)
        if ids is None:
            ids = (2, target_num_layers // 2, target_num_layers - 3)
        if len(ids) != 3 or any(not 0 <= i < target_num_layers for i in ids):
            raise ValueError(
                f"EAGLE-3 needs 3 aux layer ids in [0, {target_num_layers}) of the target, got {ids}: "
                "set eagle_aux_hidden_state_layer_ids in the head's config.json"
            )
        return ids

    def set_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Install the draft -> target id offsets [draft_vocab] int64 and the matching `t2d` mask."""
        target_ids = torch.arange(self.draft_vocab_size) + d2t.cpu()
        if d2t.shape != (self.draft_vocab_size,) or target_ids.min() < 0 or target_ids.max() >= self.vocab_size:
            raise ValueError("d2t must be [draft_vocab_size] offsets mapping every draft id into the target vocabulary")
        self.d2t.copy_(d2t)
        self.t2d.zero_()
        self.t2d[target_ids.to(self.t2d.device)] = True

    def _run(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        step: int,
    ) -> torch.Tensor:
        if hidden.shape[-1] != self.hidden_size:  # the target's 3 aux layers: project to H
            hidden = self.fc(hidden)
        embeds = nn.functional.embedding(input_ids, self._weight(self.embed_tokens, "embed_tokens")).to(hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, attend)

    def compute_draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., draft_vocab] float32 (training loss is over these)."""
        return self.lm_head(self.norm(hidden)).float()

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        """Target-vocabulary logits: draft logits at their target ids, -inf elsewhere."""
        draft = self.compute_draft_logits(hidden)
        out = draft.new_full((*draft.shape[:-1], self.vocab_size), float("-inf"))
        target_ids = torch.arange(self.draft_vocab_size, device=draft.device) + self.d2t
        return out.index_copy_(-1, target_ids, draft)

    def draft_token_ids(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        draft_ids = self.compute_draft_logits(hidden).argmax(-1)
        return draft_ids + self.d2t[draft_ids]
