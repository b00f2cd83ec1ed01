"""MTP heads (`mtp.*` tensors) for the tiny Qwen3.5 / Qwen3-Next checkpoints of the tests: random, or fitted to
a target; their tensors in a checkpoint's expert layout; and a hand-written PyTorch version of the head's formula."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from framework.models.loader import read_hf_config
from speculators.draft_heads import Qwen3NextMTPHead

Mlp = Callable[[dict[str, torch.Tensor], str, dict, torch.Tensor], torch.Tensor]


def zero_centred_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def random_mtp_tensors(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors (norm weights nonzero) for the target config in `path` (which gains
    `mtp_num_hidden_layers: 1`), named as the head's parameters (experts stacked: `checkpoint_layout`)."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    head = Qwen3NextMTPHead(read_hf_config(path))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(param.shape, generator=gen) * (0.3 if "norm" in name else 0.2)
        for name, param in head.state_dict().items()
    }


def checkpoint_layout(tensors: dict[str, torch.Tensor], fused: bool) -> dict[str, torch.Tensor]:
    """The head's stacked experts (`experts.gate_up_proj [E, 2, I, H]`, `experts.down_proj [E, H, I]`) as a
    checkpoint stores them: fused (`gate_up_proj [E, 2I, H]`, gate rows first) or one tensor per expert and
    projection (`experts.{e}.gate_proj.weight`, ...)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        stem = name.rsplit(".", 1)[0] + "."  # mtp.layers.{i}.mlp.experts.
        if name.endswith("mlp.experts.gate_up_proj"):
            if fused:
                out[name] = t.flatten(1, 2)
            for e in range(0 if fused else t.shape[0]):
                out[f"{stem}{e}.gate_proj.weight"], out[f"{stem}{e}.up_proj.weight"] = t[e, 0], t[e, 1]
        elif name.endswith("mlp.experts.down_proj") and not fused:
            out.update({f"{stem}{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return {k: v.contiguous() for k, v in out.items()}


@torch.no_grad()
def fitted_mtp_tensors(path: Path, hf_model: torch.nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """A head that drafts these sequences well: `fc` fitted (least squares) so that the first draft after
    position p, from (token p + 1, the target's hidden state at p), is token p + 2; the block's residual branches
    are kept small (attention and the MLP, experts included, still run). Later drafts feed the head's own hidden
    back: mostly wrong, so steps accept some drafts and reject others."""
    t = random_mtp_tensors(path, seed=1)
    t["mtp.norm.weight"].zero_()
    for name in t:
        if name == "mtp.layers.0.self_attn.o_proj.weight" or (name.startswith("mtp.layers.0.mlp.") and "down" in name):
            t[name] *= 0.05
    embed, lm_head = hf_model.model.embed_tokens.weight, hf_model.lm_head.weight
    eps, rows, want = hf_model.config.rms_norm_eps, [], []
    for seq in sequences:
        ids = torch.tensor(seq)
        hidden = hf_model.model(ids[None]).last_hidden_state[0]  # the target's final (normed) hidden states
        e = zero_centred_norm(embed[ids[1:-1]], t["mtp.pre_fc_norm_embedding.weight"], eps)
        h = zero_centred_norm(hidden[:-2], t["mtp.pre_fc_norm_hidden.weight"], eps)
        rows.append(torch.cat([e, h], -1))
        want.append(lm_head[ids[2:]])
    t["mtp.fc.weight"] = torch.linalg.lstsq(torch.cat(rows), torch.cat(want), driver="gelsd").solution.T
    return t


def dense_mlp(t: dict[str, torch.Tensor], p: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` from the tensors under prefix `p` (`...mlp.`)."""
    return (F.silu(x @ t[p + "gate_proj.weight"].T) * (x @ t[p + "up_proj.weight"].T)) @ t[p + "down_proj.weight"].T


def expert_weights(t: dict[str, torch.Tensor], p: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's (gate [I, H], up [I, H], down [H, I]) from per-expert tensors or the fused ones."""
    if f"{p}experts.{e}.gate_proj.weight" in t:
        return tuple(t[f"{p}experts.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))  # type: ignore[return-value]
    gate, up = t[p + "experts.gate_up_proj"][e].chunk(2, dim=0)  # gate rows first
    return gate, up, t[p + "experts.down_proj"][e]


def moe_mlp(t: dict[str, torch.Tensor], p: str, cfg: dict, x: torch.Tensor) -> torch.Tensor:
    """The sparse MoE block from the config: softmax router, top-k (renormalised), SiLU-gated experts weighted by
    their routing weight, plus the shared expert scaled by sigmoid(shared_expert_gate(x))."""
    assert cfg["architectures"][0].startswith("Qwen3_5Moe") or cfg["norm_topk_prob"]  # both renormalise
    weights, ids = (x @ t[p + "gate.weight"].T).softmax(-1).topk(cfg["num_experts_per_tok"], dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in range(cfg["num_experts"]):
        gate, up, down = expert_weights(t, p, e)
        y = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
        out += (weights * (ids == e)).sum(-1, keepdim=True) * y
    shared = dense_mlp(t, p + "shared_expert.", cfg, x)
    return out + torch.sigmoid(x @ t[p + "shared_expert_gate.weight"].T) * shared


def reference_logits(t: dict[str, torch.Tensor], cfg: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                     ids: torch.Tensor, hidden: torch.Tensor, mlp: Optional[Mlp] = None) -> torch.Tensor:  # fmt: skip
    """ids [N], hidden [N, H] (one sequence, positions 0..N-1) -> [N, vocab], straight from the config; `mlp`
    (default `dense_mlp`) computes the block's MLP from the checkpoint tensors."""
    eps, n = cfg["rms_norm_eps"], ids.shape[0]
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = cfg["rope_parameters"]
    rd = int(d * rope["partial_rotary_factor"])
    p = "mtp.layers.0."
    e = zero_centred_norm(embed[ids], t["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([e, zero_centred_norm(hidden, t["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ t["mtp.fc.weight"].T
    h = zero_centred_norm(x, t[p + "input_layernorm.weight"], eps)
    qg = (h @ t[p + "self_attn.q_proj.weight"].T).view(n, heads, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(n, heads * d)
    k = (h @ t[p + "self_attn.k_proj.weight"].T).view(n, kv, d)
    v = (h @ t[p + "self_attn.v_proj.weight"].T).view(n, kv, d)
    q = zero_centred_norm(q, t[p + "self_attn.q_norm.weight"], eps)
    k = zero_centred_norm(k, t[p + "self_attn.k_norm.weight"], eps)
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, rd, 2).float() / rd)
    ang = torch.arange(n).float()[:, None] * inv[None]  # [N, rd / 2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rot(z: torch.Tensor) -> torch.Tensor:
        a, b, rest = z[..., : rd // 2], z[..., rd // 2 : rd], z[..., rd:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)

    q, k = rot(q), rot(k).repeat_interleave(heads // kv, dim=1)
    v = v.repeat_interleave(heads // kv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    x = x + (att * torch.sigmoid(gate)) @ t[p + "self_attn.o_proj.weight"].T
    x = x + (mlp or dense_mlp)(t, p + "mlp.", cfg, zero_centred_norm(x, t[p + "post_attention_layernorm.weight"], eps))
    return zero_centred_norm(x, t["mtp.norm.weight"], eps) @ lm_head.T
