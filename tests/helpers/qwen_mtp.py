"""MTP heads (`mtp.*` tensors) for the tiny Qwen3.5 checkpoints of the tests: random, or fitted to a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from framework.models.loader import read_hf_config
from speculators.draft_heads import Qwen3NextMTPHead


def zero_centred_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def random_mtp_tensors(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random `mtp.*` tensors (norm weights nonzero) for the target config in `path` (which gains
    `mtp_num_hidden_layers: 1`)."""
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    head = Qwen3NextMTPHead(read_hf_config(path))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(param.shape, generator=gen) * (0.3 if "norm" in name else 0.2)
        for name, param in head.state_dict().items()
    }


@torch.no_grad()
def fitted_mtp_tensors(path: Path, hf_model: torch.nn.Module, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """A head that drafts these sequences well: `fc` fitted (least squares) so that the first draft after
    position p, from (token p + 1, the target's hidden state at p), is token p + 2; the block's residual branches
    are kept small (attention still runs and stores KV). Later drafts feed the head's own hidden back: mostly
    wrong, so steps accept some drafts and reject others."""
    t = random_mtp_tensors(path, seed=1)
    t["mtp.norm.weight"].zero_()
    for name in ("mtp.layers.0.self_attn.o_proj.weight", "mtp.layers.0.mlp.down_proj.weight"):
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
