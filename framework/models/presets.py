"""Embedded model geometries: HF-style configs whose weights are deterministic random numbers.

`random_tiny` is the small random-weight model the tests run on; it needs no files. Its weights are drawn at
`initializer_range` 0.2, so that its greedy output depends on the context (docs/testing.md). The default model
`tiny` is the trained model shipped as an HF directory (see `framework.models.embedded`); while its files are
absent it falls back to `random_tiny`. `qwen3-0.6b` is the geometry of the "nano" benchmark (random bf16 weights);
`qwen3-8b` the larger geometry of the parallel benchmark. `jamba-tiny` is a small Mamba-hybrid (Jamba, one
expert) for CPU runs, and `jamba-1024` the hybrid benchmark geometry: Jamba's block structure (one attention
layer in eight, at offset 4; Mamba d_state 16, d_conv 4, expand 2; vocabulary 65536) at hidden size 1024 and 16
layers, a dense MLP in every layer. `qwen3_5-tiny` is a small Gated DeltaNet hybrid (Qwen3.5 text: linear and
full attention alternating, 4 layers, hidden 64) for CPU runs; `qwen3_5-0.8b` and `qwen3_5-35b-a3b` are the
geometries of Qwen3.5-0.8B's and Qwen3.5-35B-A3B's text models with random weights (the Qwen3.5 benchmarks). All
use the byte-level tokenizer (token = UTF-8 byte, 256 = end of text).
`whisper-tiny`, `whisper-base` and `whisper-small` are Whisper geometries (encoder-decoder, audio prompts).
`qwen3-moe-tiny` is a small Qwen3-MoE (8 experts, top-2) for CPU runs, and `qwen3-30b-a3b` the MoE benchmark
geometry: Qwen3-30B-A3B's shapes (48 layers, hidden 2048, 128 experts of intermediate 768, top-8, 32/4 heads;
30.5B parameters, 61 GB in bf16) with random weights. `gpt-oss-20b` is gpt-oss-20b's geometry (24 layers alternating a
128-token window and full attention with sinks, hidden 2880, 32 experts top-4, 64/8 heads of 64, YaRN RoPE;
about 21B parameters, 42 GB in bf16 experts) with random weights; `gpt-oss-20b-mxfp4` the same with MXFP4 experts
(random bytes, one exponent for every group; about 13 GB). `gemma-3-4b` is Gemma 3 4B's text geometry (34
layers, five in six on a 1,024-token window, hidden 2560, 8/4 heads of 256, GELU-tanh, vocabulary 262,208; about
3.9B parameters) with random weights. `gemma-4-default` is the geometry of transformers' `Gemma4TextConfig`
defaults (30 layers, every sixth full attention with 512-wide heads and proportional RoPE on a quarter of them, the
others on a 512-token window with 256-wide heads, 8/4 heads, hidden 2304, MLP 9216, per-layer input embeddings of
256 per layer over 262,144 ids, tied embeddings; about 5.1B parameters, 2.0B of them the per-layer table) with
random weights and every `layer_scalar` 1.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from framework.config.schema import ConfigError
from framework.models.gemma4_config import GEMMA4_DEFAULTS

BYTE_EOS_ID = 256

# name -> (d_model, layers of encoder and of decoder, heads, ffn dim), as the OpenAI checkpoints.
_WHISPER_GEOMETRIES = {
    "whisper-tiny": (384, 4, 6, 1536),
    "whisper-base": (512, 6, 8, 2048),
    "whisper-small": (768, 12, 12, 3072),
}


def _whisper_preset(d_model: int, layers: int, heads: int, ffn: int) -> dict[str, Any]:
    """A multilingual Whisper config.json plus the generation fields the decoder prompt needs."""
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "is_encoder_decoder": True,
        "vocab_size": 51865,
        "num_mel_bins": 80,
        "d_model": d_model,
        "encoder_layers": layers,
        "decoder_layers": layers,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": ffn,
        "decoder_ffn_dim": ffn,
        "max_source_positions": 1500,
        "max_target_positions": 448,
        "activation_function": "gelu",
        "tie_word_embeddings": True,
        "eos_token_id": 50257,
        "decoder_start_token_id": 50258,
        "no_timestamps_token_id": 50363,
        "lang_to_id": {"<|en|>": 50259, "<|fr|>": 50265},
        "task_to_id": {"transcribe": 50359, "translate": 50358},
    }


# The geometry of the byte-level tiny test models (dense and MoE).
_TINY_DECODER: dict[str, Any] = {
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
}

# What the Qwen3.5 text geometries share (every released size): full attention every fourth layer, 2 KV heads of
# 256 with a gated output and a quarter of each head rotary, Gated DeltaNet heads of 128 with a 4-wide conv.
_QWEN3_5_TEXT: dict[str, Any] = {
    "vocab_size": 248320,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "eos_token_id": BYTE_EOS_ID,
}

PRESETS: dict[str, dict[str, Any]] = {
    "random_tiny": {
        **_TINY_DECODER,
        "architectures": ["Qwen3ForCausalLM"],
        # At HF's usual 0.02 the tied embedding of the last token outweighs everything attention adds, so greedy
        # output echoed the last prompt token and the engine tests could not see attention or KV bugs. At 0.2
        # attention moves the argmax: changing the first prompt token changes later greedy tokens.
        "initializer_range": 0.2,
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
    "qwen3_5-tiny": {
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "full_attention_interval": 2,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "eos_token_id": BYTE_EOS_ID,
    },
    # Qwen3.5-0.8B's text model, the family's smallest (24 layers, three Gated DeltaNet layers to one gated
    # full-attention layer; 16 key / 16 value linear heads of 128; 8/2 attention heads of 256, a quarter rotary;
    # vocabulary 248,320, tied; about 0.75B parameters) with random weights: the Qwen3.5 nano benchmark model.
    "qwen3_5-0.8b": {
        **_QWEN3_5_TEXT,
        "architectures": ["Qwen3_5ForCausalLM"],
        "hidden_size": 1024,
        "intermediate_size": 3584,
        "num_hidden_layers": 24,
        "num_attention_heads": 8,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 16,
        "tie_word_embeddings": True,
    },
    # Qwen3.5-35B-A3B's text model (40 layers in the same 3:1 pattern; 256 experts of 512, top-8, one shared
    # expert of 512; 16 key / 32 value linear heads; 16/2 attention heads of 256; about 34.7B parameters, 69 GB in
    # bf16: fits one H200) with random weights.
    "qwen3_5-35b-a3b": {
        **_QWEN3_5_TEXT,
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "tie_word_embeddings": False,
    },
    "qwen3-moe-tiny": {
        **_TINY_DECODER,
        "architectures": ["Qwen3MoeForCausalLM"],
        "moe_intermediate_size": 48,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
    },
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "tie_word_embeddings": False,
        "eos_token_id": BYTE_EOS_ID,
    },
    "gpt-oss-20b": {
        "architectures": ["GptOssForCausalLM"],
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(24)],
        "attention_bias": True,
        "swiglu_alpha": 1.702,
        "swiglu_limit": 7.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "tie_word_embeddings": False,
        "eos_token_id": BYTE_EOS_ID,
    },
    "gemma-3-4b": {
        "architectures": ["Gemma3ForCausalLM"],
        "vocab_size": 262208,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "num_hidden_layers": 34,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 131072,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        "tie_word_embeddings": True,
        "eos_token_id": BYTE_EOS_ID,
    },
}
PRESETS["gemma-4-default"] = {  # transformers' Gemma4TextConfig defaults, spelled out
    **GEMMA4_DEFAULTS,
    "architectures": ["Gemma4ForCausalLM"],
    "global_head_dim": 512,
    "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(30)],
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    },
    "num_kv_shared_layers": 0,
    "eos_token_id": BYTE_EOS_ID,
}
PRESETS["gpt-oss-20b-mxfp4"] = {  # the released checkpoints' layout: MXFP4 experts, the rest 16-bit
    **PRESETS["gpt-oss-20b"],
    "quantization_config": {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"],
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """The HF-style config of an embedded random-weight preset; `ConfigError` lists every embedded name."""
    if name not in PRESETS:
        from framework.models.embedded import SHIPPED_MODELS

        known = sorted(set(PRESETS) | set(SHIPPED_MODELS))
        raise ConfigError(not_a_preset_message(name, known))
    return copy.deepcopy(PRESETS[name])  # callers may edit it (nested dicts are shared between presets)


OFFLINE_RECIPE = "docs/getting-started.md, 'Models from the Hugging Face Hub'"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hub spells repository ids


def not_a_preset_message(name: str, known: list[str]) -> str:
    """Why `name` names no model: a directory that does not exist, a Hub id (never downloaded), or a typo."""
    if _HUB_ID.match(name):
        return (
            f"'{name}' is neither a local directory nor an embedded model. It looks like a Hugging Face Hub id: "
            f"mrv2 never downloads models; download it once (`hf download {name} --local-dir /models/"
            f"{name.split('/')[-1]}`) and pass that directory (see {OFFLINE_RECIPE})"
        )
    if "/" in name or "\\" in name or name.startswith(("~", ".")):
        return f"the model directory '{name}' does not exist (a model is a local HF directory or an embedded name)"
    return f"unknown model.preset '{name}'; embedded presets: {', '.join(known)}"
