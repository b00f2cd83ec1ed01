"""The Qwen3.5 benchmark presets against transformers' own classes: built from the same config on the meta device,
mrv2's model and HF's hold the same number of weights, and the preset's layer pattern is the released models'."""

from __future__ import annotations

import pytest
import torch
import transformers

from framework.config.registry import MODELS
from framework.models.presets import preset_config

META = torch.device("meta")


def _build_ours(cfg: dict) -> torch.nn.Module:
    """mrv2's registered class for the config, shapes only (`build_model` allocates real weights)."""
    with torch.device(META):
        return MODELS.get(cfg["architectures"][0]).from_hf_config(cfg)


# preset -> (HF config class, HF model class, parameters in billions, rounded as the docs quote them)
PRESETS = {
    "qwen3_5-0.8b": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", 0.75),
    "qwen3_5-35b-a3b": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", 34.7),
}


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights count once


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_has_the_weights_of_transformers_model(preset: str) -> None:
    config_class, model_class, billions = PRESETS[preset]
    cfg = preset_config(preset)
    hf_config = getattr(transformers, config_class)(**{k: v for k, v in cfg.items() if k != "architectures"})
    with torch.device(META):
        hf = getattr(transformers, model_class)(hf_config)
    ours = _build_ours(cfg)
    assert _numel(ours) == _numel(hf)
    assert round(_numel(ours) / 1e9, 2 if billions < 1 else 1) == billions
    kinds = hf_config.layer_types
    assert kinds.count("full_attention") * 4 == len(kinds) and kinds[3::4] == ["full_attention"] * (len(kinds) // 4)


def test_a_wrong_linear_head_count_changes_the_weights() -> None:
    """Control: the comparison sees a geometry error (value heads halved on mrv2's side only)."""
    cfg = preset_config("qwen3_5-0.8b")
    with torch.device(META):
        hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
    ours = _build_ours({**cfg, "linear_num_value_heads": 8, "linear_num_key_heads": 8})
    assert _numel(ours) != _numel(hf)
