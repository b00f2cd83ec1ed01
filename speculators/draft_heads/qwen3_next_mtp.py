"""MTP draft head of Qwen3.5 / Qwen3-Next checkpoints (`mtp.*` tensors beside the target's own).

Checkpoint layout (the target's `config.json`, `mtp_num_hidden_layers: n`, n >= 1), all norms zero-centred
(`x * (1 + w)`):

| tensor | shape | |
|---|---|---|
| `mtp.pre_fc_norm_embedding.weight` | [H] | norm of the token embedding |
| `mtp.pre_fc_norm_hidden.weight` | [H] | norm of the previous hidden state |
| `mtp.fc.weight` | [H, 2H] | over `cat(norm_e(embed(token)), norm_h(hidden))`, embedding first |
| `mtp.layers.{i}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}` | | a gated full-attention block |
| `mtp.norm.weight` | [H] | final norm; its output is both the next step's hidden state and the LM head's input |

The attention block is the target's: `q_proj` yields query and sigmoid output gate per head, q/k norms per head,
rotary on the first `partial_rotary_factor` of each head. The embedding and LM head are the target's. Draft step
s uses layer `s % n`.

The block's MLP is the target's rule for layer i (`Qwen3NextConfig.is_sparse`): dense `mlp.{gate,up,down}_proj`
(Qwen3.5), or the target's sparse MoE block where the config has experts (Qwen3-Next, Qwen3.5-MoE): router
`mlp.gate` [E, H] (softmax, top-k, renormalised), routed experts in the fused MoE kernel, and a shared expert
`mlp.shared_expert.{gate,up,down}_proj` scaled by `sigmoid(mlp.shared_expert_gate(x))` ([1, H]). Experts are
read per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, Qwen3-Next's layout) or fused
(`mlp.experts.gate_up_proj` [E, 2I, H] gate rows first and `mlp.experts.down_proj` [E, H, I], as the Qwen3.5-MoE
checkpoints store them) and stacked at load time (`stacked_tensor_part`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from framework.layers.parallel.context import ParallelContext
from framework.layers.parallel.linear import ColumnParallelLinear, RowParallelLinear, StackedPart
from framework.models.hf_config import DecoderConfig
from framework.models.moe import moe_tensor_part
from framework.models.qwen3_next import GatedMLP, OffsetRMSNorm, Qwen3NextConfig, SparseMoe
from speculators.draft_heads.base import DraftHead
from speculators.draft_heads.layers import Attend

MTP_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")


def is_qwen3_next_family(config: dict[str, Any]) -> bool:
    """Whether the config's architecture keeps its MTP head as `mtp.*` (Qwen3.5 / Qwen3-Next)."""
    arch = (config.get("architectures") or [""])[0]
    return arch in MTP_ARCHITECTURES or arch.startswith(("Qwen3_5", "Qwen3Next"))


def num_qwen_mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("mtp_num_hidden_layers") or 0)


def _rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first `cos.shape[-1]` dims of each head: x [..., N, heads, D], cos / sin [..., N, rd]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = torch.cat([-rot[..., rd // 2 :], rot[..., : rd // 2]], dim=-1)
    return torch.cat([rot * cos.unsqueeze(-2) + half * sin.unsqueeze(-2), rest], dim=-1)


class MTPGatedAttention(nn.Module):
    """The target's gated attention (same parameter names) with a pluggable `attend`."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        # Column / row-parallel layers on one rank: the linear layers a quantized checkpoint's method replaces.
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, 2 * cfg.num_heads * cfg.head_dim, bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        lead = x.shape[:-1]
        q, gate = self.q_proj(x).view(*lead, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = _rotate_partial(self.q_norm(q), cos, sin)
        k = _rotate_partial(self.k_norm(self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)), cos, sin)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        out = attend(q.contiguous(), k, v).reshape(*lead, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(*lead, -1)))


class MTPBlock(nn.Module):
    """Pre-norm gated attention and pre-norm MLP (dense, or the target's sparse MoE block), each with a residual."""

    def __init__(self, cfg: Qwen3NextConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MTPGatedAttention(cfg)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            SparseMoe(cfg) if cfg.is_sparse(layer) else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attend)
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h.reshape(-1, h.shape[-1])).view_as(h)  # the MoE block takes [T, H]


class MTPModule(nn.Module):
    """Everything under the checkpoint's `mtp.` prefix."""

    def __init__(self, cfg: Qwen3NextConfig, num_layers: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps)
        self.fc = ColumnParallelLinear(2 * h, h, False)
        self.layers = nn.ModuleList(MTPBlock(cfg, i) for i in range(num_layers))
        self.norm = OffsetRMSNorm(h, eps)


class Qwen3NextMTPHead(DraftHead):
    """The `mtp.*` head of a Qwen3.5 / Qwen3-Next target (selected by `load_draft_head` from the architecture)."""

    kind = "mtp"
    supports_quantization = True

    def __init__(self, config: dict[str, Any]) -> None:
        n = num_qwen_mtp_layers(config)
        if n < 1:
            raise ValueError("config.json has no mtp_num_hidden_layers >= 1 (the checkpoint has no MTP head)")
        qcfg = Qwen3NextConfig.from_hf({**config, "num_hidden_layers": n, "layer_types": ["full_attention"] * n})
        # The attention geometry only (a MoE config may lack a dense intermediate_size).
        dense = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": n, "intermediate_size": 1}
        layer_cfg = DecoderConfig.from_hf({**config, **dense})
        super().__init__(config, layer_cfg)
        self.qwen_config = qcfg
        self.num_layers = n
        self.inv_freq = self._inv_freq()
        self.mtp = MTPModule(qcfg, n)

    @classmethod
    def from_tensor_names(cls, config: dict[str, Any], names: set[str]) -> "Qwen3NextMTPHead":
        if not any(name.startswith("mtp.") for name in names):
            raise ValueError("the checkpoint has no mtp.* tensors (no MTP head to draft with)")
        return cls(config)

    def stacked_tensor_part(self, name: str) -> Optional[StackedPart]:
        """The MoE block's experts, per expert or fused, quantized or not, into the stacked
        `mtp.layers.{i}.mlp.experts.*` (a tensor of a layer without experts: None, reported as matching no
        parameter)."""
        return moe_tensor_part(self, name, ParallelContext())

    def _inv_freq(self) -> torch.Tensor:
        c = self.qwen_config
        arange = torch.arange(0, c.rotary_dim, 2, dtype=torch.float32, device="cpu")
        return 1.0 / c.rope_theta ** (arange / c.rotary_dim)

    def init_buffers(self) -> None:
        self.inv_freq = self._inv_freq().to(self.mtp.norm.weight.device)  # (fc may hold packed weights only)

    def _run(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        step: int,
    ) -> torch.Tensor:
        m = self.mtp
        embeds = nn.functional.embedding(input_ids, self._weight(None, "embed_tokens")).to(hidden.dtype)
        x = m.fc(torch.cat([m.pre_fc_norm_embedding(embeds), m.pre_fc_norm_hidden(hidden)], dim=-1))
        x = m.layers[step % self.num_layers](x, cos, sin, attend)
        return m.norm(x)

    def compute_logits(self, hidden: torch.Tensor, step: int = 0) -> torch.Tensor:
        return nn.functional.linear(hidden, self._weight(None, "lm_head")).float()
