"""The `gemma-4-default` random-weight preset: transformers' `Gemma4TextConfig` defaults, for the GPU benchmarks.

- every key the preset spells out equals the default of the installed transformers' `Gemma4TextConfig` (the
  reference nobody here wrote), and mrv2 reads the geometry from it (full layers: 512-wide heads, quarter-rotary
  proportional RoPE; window layers: 512 tokens) at full size, without building weights;
- at a reduced size (2 layers, small widths, the same options) the preset builds with every `layer_scalar` 1 (a
  random scalar would shrink the residual stream fifty-fold per layer) and generates tokens on the CPU;
(`conf/experiment/gemma4.yaml` composes in tests/config/test_config_groups.py, as every experiment does.)
"""

from __future__ import annotations

import pytest
import torch

from framework.models import presets
from framework.models.gemma4_config import Gemma4Config
from framework.params.sampling_params import SamplingParams

PRESET = "gemma-4-default"
NOT_HF_DEFAULTS = {"architectures", "eos_token_id", "global_head_dim"}  # mrv2's choices; global_head_dim: a kwarg


def test_preset_is_the_transformers_defaults() -> None:
    from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig

    cfg, hf = presets.preset_config(PRESET), Gemma4TextConfig()
    hf.allow_global_per_layer_attribute_access = True  # the config-wide values (the window layers')
    for key, value in cfg.items():
        if key not in NOT_HF_DEFAULTS:
            assert getattr(hf, key) == value, key
    full = [i for i, kind in enumerate(hf.layer_types) if kind == "full_attention"]
    assert all(hf.per_layer_config[i].head_dim == cfg["global_head_dim"] for i in full)
    ours = Gemma4Config.from_hf(cfg)
    assert (ours.num_layers, ours.hidden_size, ours.head_dim, ours.full_head_dim) == (30, 2304, 256, 512)
    assert ours.layer_types == tuple(hf.layer_types) and ours.sliding_window == 512 and ours.per_layer_dim == 256


def _reduced() -> dict:
    cfg = presets.preset_config(PRESET)
    cfg.update(num_hidden_layers=2, layer_types=cfg["layer_types"][4:6], hidden_size=64, intermediate_size=128)
    cfg.update(head_dim=16, global_head_dim=32, sliding_window=8, vocab_size=512, vocab_size_per_layer_input=512)
    cfg.update(hidden_size_per_layer_input=8, max_position_embeddings=128)
    return cfg


def test_reduced_preset_builds_with_unit_layer_scalars_and_generates(monkeypatch: pytest.MonkeyPatch) -> None:
    from framework.entrypoints.llm import LLM

    monkeypatch.setitem(presets.PRESETS, PRESET, _reduced())
    llm = LLM(PRESET, device="cpu", dtype="float32", max_model_len=64, seed=0)
    model = llm.engine.loaded.model
    scalars = [p for n, p in model.named_parameters() if n.endswith("layer_scalar")]
    assert len(scalars) == 2 and all(torch.equal(s, torch.ones(1)) for s in scalars)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([[5, 9, 17, 33, 2], [7, 7, 100]], greedy, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [4, 4]
