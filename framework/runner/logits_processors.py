"""The engine's side of custom logits processors: `sampler.logits_processors` names looked up in the registry.

The interface (`samplers.logits_processors.LogitsProcessor`) lives with the sampler, below the runner; finding
the classes a config names is the engine's job, so the samplers package never imports the registry or config.
"""

from __future__ import annotations

from typing import Sequence

import torch

from framework.config.registry import LOGITS_PROCESSORS, RegistryError
from framework.config.schema import ConfigError
from samplers.logits_processors import LogitsProcessor


def logits_processor_classes(names: Sequence[str]) -> list[type[LogitsProcessor]]:
    """The registered classes of `names`, checked to implement the interface (`ConfigError` otherwise)."""
    classes = []
    for name in names:
        try:
            cls = LOGITS_PROCESSORS.get(name)
        except RegistryError as err:
            raise ConfigError(f"sampler.logits_processors: {err}") from None
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError(
                f"sampler.logits_processors: '{name}' is {cls!r}, not a subclass of "
                "samplers.logits_processors.LogitsProcessor"
            )
        classes.append(cls)
    return classes


def build_logits_processors(
    names: Sequence[str], max_num_reqs: int, vocab_size: int, device: torch.device
) -> list[LogitsProcessor]:
    """Instantiate the processors named in `sampler.logits_processors` (ConfigError for a bad name)."""
    return [cls(max_num_reqs, vocab_size, device) for cls in logits_processor_classes(names)]
