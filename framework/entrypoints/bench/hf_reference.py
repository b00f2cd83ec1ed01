"""HF transformers models on the same weights as an mrv2 model: the reference for parity and baselines."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from framework.models.loaded import LoadedModel


def hf_model_from_mrv2(loaded: "LoadedModel") -> torch.nn.Module:
    """The transformers class of the same architecture, holding a copy of the mrv2 model's weights."""
    import transformers

    arch = loaded.hf_config["architectures"][0]
    cls = getattr(transformers, arch)
    cfg = cls.config_class(**{k: v for k, v in loaded.hf_config.items() if k != "architectures"})
    with torch.device(loaded.device):
        model = cls(cfg).to(loaded.dtype)
    missing, unexpected = model.load_state_dict(loaded.model.state_dict(), strict=False)
    real_missing = [
        m for m in missing if not m.endswith("inv_freq") and not (m == "lm_head.weight" and cfg.tie_word_embeddings)
    ]
    if real_missing or unexpected:
        raise RuntimeError(f"weight names differ from {arch}: missing {real_missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()
