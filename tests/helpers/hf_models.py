"""Tiny random HF transformers checkpoints for parity tests of mrv2's own model code.

Each spec builds an HF model (fp32, 2 layers, hidden 64) with weights large enough that greedy decoding does
not collapse into one repeated token, and with random norm weights and biases so that every parameter
influences the output. `save_tiny_checkpoint` writes it as config.json + model.safetensors.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer

VOCAB_SIZE = 256
# A tiny Gemma 3 text model's layers: two 8-token window layers and one full layer (KV groups, windows, parity).
TINY_GEMMA3_WINDOW = 8
TINY_GEMMA3_LAYERS: dict[str, Any] = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": TINY_GEMMA3_WINDOW,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 24,
    "tie_word_embeddings": True,
}


@dataclass(frozen=True)
class TinySpec:
    """One architecture's tiny geometry; `config_kwargs` are extra HF config arguments."""

    name: str  # pytest id
    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    config_class: str  # HF config class name
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,  # HF's default 0.02 makes tiny random models repeat one token forever
    # No special tokens: neither side may stop early, both produce exactly max_tokens tokens.
    "eos_token_id": None,
    "bos_token_id": None,
    "pad_token_id": None,
}

SPECS: list[TinySpec] = [
    # Multi-head attention (kv heads == heads), untied lm_head.
    TinySpec(
        "llama", "LlamaForCausalLM", "LlamaConfig", {"num_key_value_heads": 4, "tie_word_embeddings": False}, seed=1
    ),
    # Bias on q/k/v (not on o_proj), grouped-query attention, a non-default rope theta.
    TinySpec(
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {"num_key_value_heads": 2, "tie_word_embeddings": False, "rope_theta": 1000.0, "use_sliding_window": False},
        seed=2,
    ),
    # q/k RMSNorm per head, GQA, tied embeddings, head_dim * heads (128) != hidden_size (64).
    TinySpec(
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        {"num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": True, "use_sliding_window": False},
        seed=3,
    ),
    # Llama 3 RoPE scaling: with original_max_position_embeddings=32 and head_dim 16 the frequencies fall in
    # all three bands (kept, scaled, smoothed), and prompts + outputs run past position 32.
    TinySpec(
        "llama-rope-llama3",
        "LlamaForCausalLM",
        "LlamaConfig",
        {
            "num_key_value_heads": 4,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        },
        seed=5,
    ),
    # GQA with 4:1 grouping (8 heads of 8, 2 kv heads), no sliding window.
    TinySpec(
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        {"num_attention_heads": 8, "num_key_value_heads": 2, "sliding_window": None, "tie_word_embeddings": False},
        seed=4,
    ),
]
SPEC_BY_NAME = {s.name: s for s in SPECS}


def build_hf_model(spec: TinySpec) -> torch.nn.Module:
    """The HF model of `spec`, deterministic for its seed, in eval mode."""
    import transformers

    kwargs = {**_COMMON, **spec.config_kwargs}
    if "rope_theta" in kwargs:  # transformers 5 reads rope settings from rope_parameters
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    config = getattr(transformers, spec.config_class)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(spec.seed)
    model = getattr(transformers, spec.architecture)(config).eval()
    gen = torch.Generator().manual_seed(spec.seed + 1000)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # HF initialises norms to 1: randomise so a missing/misplaced norm shows
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):  # HF initialises biases to 0: randomise so a missing bias shows
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def save_tiny_checkpoint(spec: TinySpec, path: Path) -> torch.nn.Module:
    """Build the HF model of `spec`, save it (safetensors) under `path`, and return it."""
    model = build_hf_model(spec)
    model.save_pretrained(path, safe_serialization=True)
    assert list(path.glob("*.safetensors")), "save_pretrained did not write safetensors"
    return model


def random_prompts(num: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`num` prompts of random token ids, lengths spread over [min_len, max_len] (all different when possible)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(min_len, max_len, num).round().long().tolist()
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate` greedy continuation of one prompt (batch of one: no padding)."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,
        pad_token_id=None,
    )
    return out[0, len(prompt) :].tolist()


@torch.no_grad()
def hf_logits(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab] float32 logits of one full sequence (row i predicts token i+1)."""
    return model(torch.tensor([token_ids])).logits[0].float()


class Fp8RoundingLayer(DynamicLayer):
    """HF's dynamic cache layer, storing each new K and V as torch's float8_e4m3fn cast rounds them (saturating):
    HF's attention over what mrv2's FP8 KV cache (`cache.kv_cache_dtype=fp8`) holds."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):  # type: ignore[override]
        def rounded(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.float8_e4m3fn).to(t.dtype)

        return super().update(rounded(key_states), rounded(value_states), *args, **kwargs)


def fp8_rounding_cache(num_layers: int) -> Cache:
    return Cache(layers=[Fp8RoundingLayer() for _ in range(num_layers)])


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward's name for the KV cache: `cache` from transformers 5.25 (`past_key_values` warns there and goes
    in 5.40), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
