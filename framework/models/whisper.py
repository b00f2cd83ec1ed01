"""Whisper (encoder-decoder) on the paged KV cache: the encoder runs once per request, the decoder every step.

Parameter names match HF `WhisperForConditionalGeneration` checkpoints (`model.encoder.conv1.weight`,
`model.decoder.layers.N.encoder_attn.q_proj.weight`, `proj_out.weight` tied to the token embedding), so
weights load by name. The encoder turns log-mel features into cross-attention keys and values
(`encode`), which the `EncoderDecoderModelState` keeps per request slot; the decoder's self-attention reads
and writes the paged KV cache like the decoder-only models.

Cross-attention runs on the same paged-attention kernels: each slot's encoder K/V sit in fixed blocks of a
paged cross cache, and every decoder token is its own attention row with KV length `enc_len` and one query
at the last position, so the causal kernel attends over all encoder positions (no mask: Whisper always
encodes a padded 30 s window). No K/V is gathered or copied per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from framework.layers.attention import AttentionMetadata
from framework.layers.attention.backend import paged_attention, store_kv
from framework.models.hf_config import UnsupportedModelError
from framework.models.interface import EncoderDecoder, Model


@dataclass(frozen=True)
class WhisperGeometry:
    """The fields of an HF `WhisperConfig` that the model code reads."""

    vocab_size: int
    num_mel_bins: int
    d_model: int
    encoder_layers: int
    encoder_heads: int
    encoder_ffn_dim: int
    decoder_layers: int
    decoder_heads: int
    decoder_ffn_dim: int
    max_source_positions: int  # encoder output length (= mel frames / 2)
    max_target_positions: int  # longest decoder sequence

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "WhisperGeometry":
        """Read an HF config dict; options the model code does not implement raise `UnsupportedModelError`."""
        act = cfg.get("activation_function", "gelu")
        if act != "gelu":
            raise UnsupportedModelError(f"activation_function={act!r} is not supported for Whisper (only 'gelu')")
        if cfg.get("scale_embedding"):
            raise UnsupportedModelError("scale_embedding=true is not supported for Whisper")
        if cfg.get("tie_word_embeddings") is False:
            raise UnsupportedModelError("tie_word_embeddings=false is not supported for Whisper")
        geometry = cls(
            vocab_size=cfg["vocab_size"],
            num_mel_bins=cfg.get("num_mel_bins", 80),
            d_model=cfg["d_model"],
            encoder_layers=cfg["encoder_layers"],
            encoder_heads=cfg["encoder_attention_heads"],
            encoder_ffn_dim=cfg["encoder_ffn_dim"],
            decoder_layers=cfg["decoder_layers"],
            decoder_heads=cfg["decoder_attention_heads"],
            decoder_ffn_dim=cfg["decoder_ffn_dim"],
            max_source_positions=cfg.get("max_source_positions", 1500),
            max_target_positions=cfg.get("max_target_positions", 448),
        )
        for name, heads in (("encoder", geometry.encoder_heads), ("decoder", geometry.decoder_heads)):
            if geometry.d_model % heads:
                raise UnsupportedModelError(
                    f"d_model={geometry.d_model} is not a multiple of {name}_attention_heads={heads}"
                )
        return geometry

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_heads

    @property
    def num_mel_frames(self) -> int:
        """Mel frames the encoder takes (conv2 has stride 2): 3000 for 30 s of audio at Whisper's 10 ms hop."""
        return 2 * self.max_source_positions


class CrossAttentionInputs(NamedTuple):
    """What the decoder's cross-attention reads this step (built by `EncoderDecoderModelState.prepare_inputs`)."""

    cross_kv: torch.Tensor  # [decoder_layers, 2, num_cross_blocks, block_size, heads, head_dim]: paged, per slot
    meta: AttentionMetadata  # one row per token: seq_len enc_len, that token's slot's cross blocks


class WhisperSelfAttention(nn.Module):
    """q/k/v/out projections (no bias on k, as in Whisper); used by the encoder and both decoder attentions."""

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, d_model // num_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d_model] -> [..., heads, head_dim], scaled before the product as HF Whisper does."""
        return (self.q_proj(x) * self.scaling).view(*x.shape[:-1], self.num_heads, self.head_dim)

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., d_model] -> K, V [..., heads, head_dim]."""
        shape = (*x.shape[:-1], self.num_heads, self.head_dim)
        return self.k_proj(x).view(shape), self.v_proj(x).view(shape)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.self_attn = WhisperSelfAttention(g.d_model, g.encoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(g.d_model)
        self.fc1 = nn.Linear(g.d_model, g.encoder_ffn_dim)
        self.fc2 = nn.Linear(g.encoder_ffn_dim, g.d_model)
        self.final_layer_norm = nn.LayerNorm(g.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, L, d_model]
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.query(h).transpose(1, 2)  # [B, H, L, D]
        k, v = (t.transpose(1, 2) for t in self.self_attn.key_value(h))
        attn = F.scaled_dot_product_attention(q, k, v, scale=1.0).transpose(1, 2).flatten(2)
        x = x + self.self_attn.out_proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(g.num_mel_bins, g.d_model, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(g.d_model, g.d_model, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(g.max_source_positions, g.d_model)
        self.layers = nn.ModuleList(WhisperEncoderLayer(g) for _ in range(g.encoder_layers))
        self.layer_norm = nn.LayerNorm(g.d_model)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[B, mel_bins, frames] -> [B, max_source_positions, d_model]."""
        x = F.gelu(self.conv2(F.gelu(self.conv1(features)))).transpose(1, 2)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoderLayer(nn.Module):
    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.self_attn = WhisperSelfAttention(g.d_model, g.decoder_heads)
        self.self_attn_layer_norm = nn.LayerNorm(g.d_model)
        self.encoder_attn = WhisperSelfAttention(g.d_model, g.decoder_heads)
        self.encoder_attn_layer_norm = nn.LayerNorm(g.d_model)
        self.fc1 = nn.Linear(g.d_model, g.decoder_ffn_dim)
        self.fc2 = nn.Linear(g.decoder_ffn_dim, g.d_model)
        self.final_layer_norm = nn.LayerNorm(g.d_model)
        self.kernel_backend = "auto"  # kernels.backend, handed down by the loader (set_kernel_backend)

    def forward(
        self,
        x: torch.Tensor,  # [T, d_model]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, heads, head_dim]
        meta: AttentionMetadata,
        layer_kv: torch.Tensor,  # [2, num_cross_blocks, block_size, heads, head_dim]: this layer's cross K/V
        cross: CrossAttentionInputs,
    ) -> torch.Tensor:
        t = x.shape[0]
        h = self.self_attn_layer_norm(x)
        q = self.self_attn.query(h)
        k, v = self.self_attn.key_value(h)
        backend = self.kernel_backend
        store_kv(k, v, kv_cache, meta.kv_slot_mapping, backend=backend)
        x = x + self.self_attn.out_proj(paged_attention(q, kv_cache, meta, 1.0, backend=backend).reshape(t, -1))
        q = self.encoder_attn.query(self.encoder_attn_layer_norm(x))
        cross_out = paged_attention(q, layer_kv, cross.meta, 1.0, backend=backend)
        x = x + self.encoder_attn.out_proj(cross_out.reshape(t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoder(nn.Module):
    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(g.vocab_size, g.d_model)
        self.embed_positions = nn.Embedding(g.max_target_positions, g.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(g) for _ in range(g.decoder_layers))
        self.layer_norm = nn.LayerNorm(g.d_model)


class WhisperModel(nn.Module):
    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.encoder = WhisperEncoder(g)
        self.decoder = WhisperDecoder(g)


class WhisperForConditionalGeneration(Model, EncoderDecoder):
    """Whisper speech-to-text: `encode` once per request, `forward` (decoder) every step.

    `forward` returns decoder hidden states `[T, d_model]`; `compute_logits` projects the sampled rows with
    the (tied) token embedding.
    """

    waits_per_kv_layer = True  # the forward waits for each paged layer's KV-tier loads (Model)

    model_state_name = "encoder_decoder"  # the runner gives it an EncoderDecoderModelState

    def __init__(self, g: WhisperGeometry) -> None:
        super().__init__()
        self.geometry = g
        self.model = WhisperModel(g)
        self.proj_out = nn.Linear(g.d_model, g.vocab_size, bias=False)
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, hf_config: dict) -> "WhisperForConditionalGeneration":
        """Build (uninitialised) from an HF config dict."""
        return cls(WhisperGeometry.from_hf(hf_config))

    @property
    def num_kv_layers(self) -> int:
        """Decoder layers (self-attention on the paged KV cache)."""
        return self.geometry.decoder_layers

    @property
    def kv_heads(self) -> int:
        return self.geometry.decoder_heads

    @property
    def kv_head_dim(self) -> int:
        return self.geometry.head_dim

    def cross_kv_shape(self) -> tuple[int, ...]:
        """Shape of one request's cross-attention K/V: [decoder_layers, 2, enc_len, heads, head_dim]."""
        g = self.geometry
        return (g.decoder_layers, 2, g.max_source_positions, g.decoder_heads, g.head_dim)

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Log-mel features [B, mel_bins, frames] -> cross-attention K/V [B, decoder_layers, 2, enc_len, heads, D].

        The encoder output is projected by every decoder layer's `encoder_attn.k_proj` / `v_proj` here, once,
        so decode steps only read the result.
        """
        dtype = self.proj_out.weight.dtype
        enc = self.model.encoder(features.to(dtype))  # [B, L, d_model]
        per_layer = []
        for layer in self.model.decoder.layers:
            k, v = layer.encoder_attn.key_value(enc)  # [B, L, H, D]
            per_layer.append(torch.stack([k, v], dim=1))  # [B, 2, L, H, D]
        return torch.stack(per_layer, dim=1)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        cross: CrossAttentionInputs,
    ) -> torch.Tensor:
        dec = self.model.decoder
        x = dec.embed_tokens(input_ids) + dec.embed_positions(positions)
        for i, (layer, kv_cache) in enumerate(zip(dec.layers, kv_caches)):
            attn_metadata.kv_waits.layer(i)  # a KV tier's loads of this layer are in place (no-op without)
            x = layer(x, kv_cache, attn_metadata, cross.cross_kv[i], cross)
        return dec.layer_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[L, d_model] -> [L, vocab] in the model dtype (as `LlamaForCausalLM.compute_logits`)."""
        return self.proj_out(hidden)
