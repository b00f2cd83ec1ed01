"""SteeredQwen3ForCausalLM: Qwen3 whose input embeddings a SteeringModelState can shift per request."""

from __future__ import annotations

import torch

from framework.models.llama import LlamaForCausalLM


class SteeredQwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 checkpoint (same weights and names) that reads the `steering` model state's inputs."""

    model_state_name = "steering"

    @classmethod
    def from_hf_config(cls, hf_config):
        return super().from_hf_config({**hf_config, "architectures": ["Qwen3ForCausalLM"]})

    def forward(self, input_ids, positions, kv_caches, attn_metadata, steer_token_ids, steer_scales):
        embed = self.model.embed_tokens
        x = embed(input_ids) + steer_scales.unsqueeze(1).to(embed.weight.dtype) * embed(steer_token_ids)
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)  # [T, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x = layer(x, cos, sin, kv_cache, attn_metadata, self.attention)
        return self.model.norm(x)
