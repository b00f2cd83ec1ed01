"""Tiny random HF Mixture-of-Experts checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral) for parity tests.

Same recipe as `hf_models` (2 layers, hidden 64, weights large enough that greedy decoding varies, random norms
and biases); the specs vary what the MoE code must get right: the number of experts and top-k (top-k equal to
the number of experts, top-1), `norm_topk_prob` on and off, tied and untied embeddings, dense layers from
`decoder_sparse_step` and `mlp_only_layers`, and Qwen2-MoE's shared expert.
"""

from __future__ import annotations

from helpers.hf_models import TinySpec

_QWEN = {"num_key_value_heads": 2, "use_sliding_window": False}

MOE_SPECS: list[TinySpec] = [
    # 8 experts, top-2, renormalised, tied embeddings, q/k norms, head_dim * heads != hidden.
    TinySpec(
        "qwen3moe-e8k2-norm-tied",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **_QWEN,
            "head_dim": 32,
            "tie_word_embeddings": True,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
        },
        seed=11,
    ),
    # top-k = number of experts, raw softmax weights, untied; decoder_sparse_step 2: layer 0 dense, layer 1 MoE.
    TinySpec(
        "qwen3moe-e4k4-step2",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        {
            **_QWEN,
            "head_dim": 16,
            "tie_word_embeddings": False,
            "num_experts": 4,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
        seed=12,
    ),
    # Shared expert with its sigmoid gate, qkv bias, layer 0 MLP-only, 6 experts top-3 unnormalised.
    TinySpec(
        "qwen2moe-e6k3-shared",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            **_QWEN,
            "tie_word_embeddings": False,
            "num_experts": 6,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 96,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
        seed=13,
    ),
    # Top-1 renormalised (every weight 1), tied, shared expert.
    TinySpec(
        "qwen2moe-e4k1-norm-tied",
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            **_QWEN,
            "tie_word_embeddings": True,
            "num_experts": 4,
            "num_experts_per_tok": 1,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 64,
            "norm_topk_prob": True,
        },
        seed=14,
    ),
    # Mixtral: always renormalised, router weights in float32, `block_sparse_moe` / w1 w2 w3 names.
    TinySpec(
        "mixtral-e6k2",
        "MixtralForCausalLM",
        "MixtralConfig",
        {
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "sliding_window": None,
        },
        seed=15,
    ),
]
MOE_SPEC_BY_NAME = {s.name: s for s in MOE_SPECS}
