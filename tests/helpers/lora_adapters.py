"""Tiny random PEFT LoRA adapters, written by PEFT itself (adapter_config.json + adapter_model.safetensors), and
HF transformers + PEFT as the reference that runs them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from helpers.hf_models import TinySpec, build_hf_model

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    """One adapter: its target modules, rank, alpha, rsLoRA, and the seed of its random weights."""

    name: str
    targets: tuple[str, ...]
    rank: int
    alpha: float
    use_rslora: bool = False
    seed: int = 0


ADAPTERS = [
    AdapterSpec("all7-r8", ALL_PROJECTIONS, 8, 16.0, seed=11),
    AdapterSpec("qv-r4-rslora", ("q_proj", "v_proj"), 4, 8.0, use_rslora=True, seed=12),
    AdapterSpec("o-down-r16", ("o_proj", "down_proj"), 16, 8.0, seed=13),
    AdapterSpec("kv-gateup-r2", ("k_proj", "v_proj", "gate_proj", "up_proj"), 2, 4.0, seed=14),
]


def save_adapter(base: TinySpec, spec: AdapterSpec, path: Path) -> Path:
    """Build `spec` on the HF model of `base` with PEFT, give its A and B random weights large enough to change
    greedy tokens, and save it with PEFT's `save_pretrained` (safetensors)."""
    from peft import LoraConfig, get_peft_model

    model = build_hf_model(base)
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.targets),
        use_rslora=spec.use_rslora,
        lora_dropout=0.0,
        bias="none",
        init_lora_weights=False,
    )
    peft_model = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.15)
    peft_model.save_pretrained(str(path), safe_serialization=True)
    assert (path / "adapter_model.safetensors").is_file()
    return path


def hf_peft_model(base: TinySpec, adapter_path: Path) -> torch.nn.Module:
    """HF transformers + PEFT running the saved adapter on a fresh copy of the base (eval mode)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(build_hf_model(base), str(adapter_path)).eval()
