"""Embedded model geometries: HF-style configs whose weights are deterministic random numbers.

`random_tiny` is the small random-weight model the tests run on; it needs no files. `qwen3-0.6b` is the
geometry of the "nano" benchmark (random bf16 weights). Both use the byte-level tokenizer (token = UTF-8
byte, 256 = end of text). The default model `tiny` is the trained model shipped as an HF directory (see
`framework.models.embedded`); while its files are absent it falls back to `random_tiny`.
`whisper-tiny`, `whisper-base` and `whisper-small` are Whisper geometries (encoder-decoder, audio prompts).
"""

from __future__ import annotations

from typing import Any

BYTE_EOS_ID = 256

# name -> (d_model, layers of encoder and of decoder, heads, ffn dim), as the OpenAI checkpoints.
_WHISPER_GEOMETRIES = {"whisper-tiny": (384, 4, 6, 1536), "whisper-base": (512, 6, 8, 2048),
                       "whisper-small": (768, 12, 12, 3072)}


def _whisper_preset(d_model: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """A multilingual Whisper config.json plus the generation fields the decoder prompt needs."""
    return {
        "architectures": ["WhisperForConditionalGeneration"], "is_encoder_decoder": True,
        "vocab_size": 51865, "num_mel_bins": 80, "d_model": d_model, "encoder_layers": layers,
        "decoder_layers": layers, "encoder_attention_heads": heads, "decoder_attention_heads": heads,
        "encoder_ffn_dim": ffn, "decoder_ffn_dim": ffn, "max_source_positions": 1500, "max_target_positions": 448,
        "activation_function": "gelu", "tie_word_embeddings": True,
        "eos_token_id": 50257, "decoder_start_token_id": 50258, "no_timestamps_token_id": 50363,
        "lang_to_id": {"<|en|>": 50259, "<|fr|>": 50265}, "task_to_id": {"transcribe": 50359, "translate": 50358},
    }


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
    # Whisper geometries (random weights; the byte tokenizer decodes none of Whisper's ids). Prompts are audio.
    **{name: _whisper_preset(*geometry) for name, geometry in _WHISPER_GEOMETRIES.items()},
}


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config of an embedded random-weight preset; the error lists every embedded name."""
    if name not in PRESETS:
        from framework.models.embedded import SHIPPED_MODELS

        known = sorted(set(PRESETS) | set(SHIPPED_MODELS))
        raise ValueError(f"unknown model.preset '{name}'; embedded presets: {', '.join(known)}")
    return dict(PRESETS[name])
