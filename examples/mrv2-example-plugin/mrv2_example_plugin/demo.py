"""A small random-weight checkpoint of SteeredQwen3ForCausalLM, so the example runs without downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from framework.models.loader import build_model, init_random_weights
from framework.models.presets import PRESETS


def write_demo_checkpoint(path, seed=0):
    """Write config.json + model.safetensors (the geometry of mrv2's `random_tiny` preset) under `path`."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = {**PRESETS["random_tiny"], "architectures": ["SteeredQwen3ForCausalLM"]}
    model = build_model(config, torch.float32, torch.device("cpu"))
    init_random_weights(model, seed, config.get("initializer_range", 0.02))
    (root / "config.json").write_text(json.dumps(config, indent=2))
    # named_parameters() lists a tied weight once; the loader accepts the checkpoint without the duplicate.
    save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, root / "model.safetensors")
    return str(root)
