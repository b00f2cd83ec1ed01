"""Tiny random HF checkpoints of the Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next, Qwen3.5-MoE) for the tests."""

from __future__ import annotations

from pathlib import Path

import torch

from helpers.hf_models import TinySpec, build_hf_model

_GEOMETRY = {
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "tie_word_embeddings": False,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
QWEN3_5 = TinySpec("qwen3_5", "Qwen3_5ForCausalLM", "Qwen3_5TextConfig", {**_GEOMETRY, "full_attention_interval": 2})
QWEN3_NEXT = TinySpec(
    "qwen3_next",
    "Qwen3NextForCausalLM",
    "Qwen3NextConfig",
    {
        **_GEOMETRY,
        **_MOE,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "mlp_only_layers": [2],
        "norm_topk_prob": True,
    },
    seed=2,
)
QWEN3_5_MOE = TinySpec(
    "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeTextConfig",
    {**_GEOMETRY, **_MOE, "full_attention_interval": 2},
    seed=3,
)


def slow_decay_model(spec: TinySpec) -> torch.nn.Module:
    """The HF model of `spec` with slow decay rates (HF's init decays the state by e^-5 or more per token, so a
    wrong or lost state would hardly show in the outputs)."""
    model = build_hf_model(spec)
    gen = torch.Generator().manual_seed(spec.seed + 7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_((0.02 + 0.2 * torch.rand(param.shape, generator=gen)).log())
    return model


def slow_decay_checkpoint(spec: TinySpec, path: Path) -> torch.nn.Module:
    """`slow_decay_model(spec)` saved under `path`."""
    model = slow_decay_model(spec)
    model.save_pretrained(path, safe_serialization=True)
    return model
