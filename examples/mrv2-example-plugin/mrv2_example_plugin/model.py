"""SteeredQwen3ForCausalLM: Qwen3 whose input embeddings a SteeringModelState can shift per request."""

from __future__ import annotations

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
        # The steered embeddings enter the layers where a pipeline stage's input would: the rest is Qwen3's.
        return super().forward(input_ids, positions, kv_caches, attn_metadata, pp_hidden=x)
