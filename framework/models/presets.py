"""Embedded model geometries: HF-style configs whose weights are deterministic random numbers.

`tiny` is the default model of `mrv2 run`; it needs no files. `qwen3-0.6b` is the geometry of the "nano"
benchmark (random bf16 weights); `qwen3-8b` the larger geometry of the parallel benchmark. Both use the byte-level tokenizer (token = UTF-8 byte, 256 = end of text).
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
    # Qwen3-8B shapes (untied LM head): the larger geometry of the parallel benchmark, random bf16 weights.
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "eos_token_id": BYTE_EOS_ID,
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config of an embedded preset; the error lists the known names."""
    if name not in PRESETS:
        raise ValueError(f"unknown model.preset '{name}'; embedded presets: {', '.join(sorted(PRESETS))}")
    return dict(PRESETS[name])
