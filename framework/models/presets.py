"""Embedded model geometries: HF-style configs whose weights are deterministic random numbers.

`tiny` is the default model of `mrv2 run`; it needs no files. `qwen3-0.6b` is the geometry of the "nano"
benchmark (random bf16 weights). `jamba-tiny` is a small Mamba-hybrid (Jamba, one expert) for CPU runs, and
`jamba-1024` the hybrid benchmark geometry: Jamba's block structure (one attention layer in eight, at offset 4;
Mamba d_state 16, d_conv 4, expand 2; vocabulary 65536) at hidden size 1024 and 16 layers, a dense MLP in every
layer. All use the byte-level tokenizer (token = UTF-8 byte, 256 = end of text).
"""

from __future__ import annotations

from typing import Any

BYTE_EOS_ID = 256

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "eos_token_id": BYTE_EOS_ID,
    },
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "eos_token_id": BYTE_EOS_ID,
    },
    "jamba-tiny": {
        "architectures": ["JambaForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "num_experts": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 4,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "eos_token_id": BYTE_EOS_ID,
    },
    "jamba-1024": {
        "architectures": ["JambaForCausalLM"],
        "vocab_size": 65536,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "num_experts": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 64,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
        "eos_token_id": BYTE_EOS_ID,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config of an embedded preset; the error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model.preset '{name}'; embedded presets: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
