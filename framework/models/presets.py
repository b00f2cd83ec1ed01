"""Embedded model geometries: HF-style configs whose weights are deterministic random numbers.

`random_tiny` is the small random-weight model the tests run on; it needs no files. `qwen3-0.6b` is the
geometry of the "nano" benchmark (random bf16 weights). Both use the byte-level tokenizer (token = UTF-8
byte, 256 = end of text). The default model `tiny` is the trained model shipped as an HF directory (see
`framework.models.embedded`); while its files are absent it falls back to `random_tiny`.
"""

from __future__ import annotations

from typing import Any

BYTE_EOS_ID = 256

PRESETS: dict[str, dict[str, Any]] = {
    "random_tiny": {
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
}


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config of an embedded random-weight preset; the error lists every embedded name."""
    if name not in PRESETS:
        from framework.models.embedded import SHIPPED_MODELS

        known = sorted(set(PRESETS) | set(SHIPPED_MODELS))
        raise ValueError(f"unknown model.preset '{name}'; embedded presets: {', '.join(known)}")
    return dict(PRESETS[name])
