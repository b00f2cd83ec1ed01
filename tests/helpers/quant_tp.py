"""Tensor parallelism of quantized checkpoints in one process: the whole model and each rank's model, loaded from
the same checkpoint, to compare a layer's product with the sum (row-parallel) or concatenation (column-parallel) of
its ranks' products."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from framework.layers.parallel.context import ParallelContext
from framework.layers.quantization import finish_quantization
from framework.models.loader import build_model, load_safetensors_weights, read_hf_config
from helpers.hf_models import TinySpec

CPU = torch.device("cpu")
# Qwen3-MoE whose every projection splits on 128-boundaries under tp=2 (FP8 blocks): q 256 rows, k/v 256 rows,
# o_proj 256 inputs, experts' intermediate 256 (128 per rank); 4 experts, top-2.
MOE_TP_SPEC = TinySpec(
    "qwen3moe-quant-tp",
    "Qwen3MoeForCausalLM",
    "Qwen3MoeConfig",
    {
        "hidden_size": 256,
        "intermediate_size": 256,
        "moe_intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "initializer_range": 0.1,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    seed=31,
)


def load_model(
    path: Path, ctx: Optional[ParallelContext] = None, quantization: Optional[str] = None
) -> torch.nn.Module:
    """The checkpoint at `path` loaded and finished as the engine does (float32, CPU), whole or as rank `ctx`;
    `quantization`: an online format (`fp8`)."""
    hf = read_hf_config(path)
    model = build_model(hf, torch.float32, CPU, ParallelContext() if ctx is None else ctx, quantization)
    load_safetensors_weights(model, path)
    finish_quantization(model)
    return model


def whole_and_ranks(path: Path, tp: int = 2) -> tuple[torch.nn.Module, list[torch.nn.Module]]:
    """The one-process model and the `tp` ranks' models of the checkpoint at `path`."""
    return load_model(path), [load_model(path, ParallelContext(tp_size=tp, rank=r)) for r in range(tp)]


def linear_products(whole: torch.nn.Module, ranks: list[torch.nn.Module], name: str, x: torch.Tensor) -> tuple:
    """(the whole layer's x @ W^T, the ranks' products combined): row-parallel layers (o_proj, down_proj) get each
    rank's input columns and their partial products are summed, column-parallel ones are concatenated."""
    full = whole.get_submodule(name)
    parts = [m.get_submodule(name) for m in ranks]
    k = full.in_features
    if name.endswith(("o_proj", "down_proj")):
        per = parts[0].in_features
        got = sum(p.quant_method.apply(p, x[:, r * per : (r + 1) * per], None) for r, p in enumerate(parts))
    else:
        got = torch.cat([p.quant_method.apply(p, x[:, :k], None) for p in parts], dim=-1)
    return full.quant_method.apply(full, x[:, :k], None), got


def expert_products(whole: torch.nn.Module, ranks: list[torch.nn.Module], layer: int, seed: int = 0) -> tuple:
    """(the whole experts' MoE output, the sum of the ranks') of decoder layer `layer` on random tokens and routing."""
    experts = [m.model.layers[layer].mlp.experts for m in (whole, *ranks)]
    e, _, h = experts[0].expert_dims
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, h, generator=g)
    weights, ids = torch.softmax(torch.randn(5, e, generator=g), -1).topk(2, dim=-1)
    outs = [m.quant_method.apply_experts(m, x, weights, ids, "reference") for m in experts]
    return outs[0], sum(outs[1:])
