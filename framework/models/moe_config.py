"""The Mixture-of-Experts geometry mrv2 reads from an HF `config.json` (Qwen3-MoE, Qwen2-MoE, Mixtral)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from framework.models.hf_config import DecoderConfig, UnsupportedModelError

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeConfig(DecoderConfig):
    """A decoder whose MLPs are (mostly) sparse MoE blocks; the attention fields are `DecoderConfig`'s.

    `intermediate_size` stays the dense MLP's (layers in `mlp_only_layers` or off the `decoder_sparse_step`
    grid); each expert has `moe_intermediate_size`.
    """

    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k softmax probabilities to sum to 1
    round_router_weights: bool = True  # Qwen rounds the top-k weights to the model dtype; Mixtral keeps float32
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's always-on expert (0: none)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "MoeConfig":
        """Read an HF MoE config dict; inconsistent or unsupported options raise `UnsupportedModelError`."""
        base = super().from_hf(cfg)
        arch = base.architecture
        if arch not in MOE_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {arch!r} is not a MoE family mrv2 knows ({', '.join(MOE_ARCHITECTURES)})"
            )
        mixtral = arch == "MixtralForCausalLM"
        # Mixtral says num_local_experts; Qwen says num_experts (transformers 5.24 writes either name for Qwen3).
        num_experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        top_k = int(cfg.get("num_experts_per_tok") or (2 if mixtral else 1))
        if num_experts > 0 and not 1 <= top_k <= num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({num_experts})"
            )
        step = int(1 if cfg.get("decoder_sparse_step") is None else cfg["decoder_sparse_step"])
        if step < 1:
            raise UnsupportedModelError(f"decoder_sparse_step={step} must be >= 1")
        expert_size = base.intermediate_size if mixtral else int(cfg.get("moe_intermediate_size") or 0)
        if num_experts > 0 and expert_size <= 0:
            raise UnsupportedModelError("moe_intermediate_size must be set (> 0) for a model with experts")
        extra: dict[str, Any] = {}
        if arch == "Qwen2MoeForCausalLM" and "qkv_bias" in cfg:  # newer Qwen2-MoE configs say it explicitly
            extra["qkv_bias"] = bool(cfg["qkv_bias"])
        return dataclasses.replace(
            base,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=expert_size,
            norm_topk_prob=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
            round_router_weights=not mixtral,
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if arch == "Qwen2MoeForCausalLM"
            else 0,
            decoder_sparse_step=1 if mixtral else step,
            mlp_only_layers=() if mixtral else tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
            **extra,
        )

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` has a MoE block (HF's rule: not MLP-only, and on the sparse-step grid)."""
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )
