"""Runner selection: which features of a config V2 does not support, and which runner to use.

Every reason in `v2_unsupported_reasons` is real: an environment the V2 runner cannot run in, or a
declared capability that only V1 offers. Today there are two:

- **Triton on CUDA.** On a CUDA device V2 prepares inputs, gathers block tables and samples with Triton
  kernels (its PyTorch references are the CPU path). Without an importable Triton, or on a GPU older than
  Triton's minimum compute capability, V2 cannot run there; V1 builds inputs with NumPy and, without Triton,
  runs eagerly and samples with PyTorch operations, which run on any CUDA device (with Triton it uses V2's
  fused sampler and decode graphs: `triton_reasons`).
- **A ModelState that declares `supports_v2 = False`.** A third-party state whose hooks need V1's
  synchronous step (see `ModelState.supports_v2`) says so, and V2 must not drive it.

No model family is a reason: dense decoders, the MoE families (Qwen3-MoE, Qwen2-MoE, Mixtral), Whisper and
Jamba all run on V2.
"""

from __future__ import annotations

import logging
from typing import Optional

from framework.config.schema import ConfigError, Mrv2Config
from framework.layers.kernels.triton_support import triton_reasons

logger = logging.getLogger(__name__)


def configured_model_state(config: Mrv2Config) -> Optional[type]:
    """The ModelState class the engine will build for `config`, found without building the model (None when
    the model's architecture is not registered: loading the model reports that)."""
    from framework.config.registry import MODELS
    from framework.models.embedded import resolve_model_source
    from framework.models.loader import read_hf_config
    from framework.models.presets import preset_config
    from framework.runner.plugins import model_state_class

    source = resolve_model_source(config.model.path, config.model.preset)
    hf_config = read_hf_config(source.path) if source.path else preset_config(source.preset or "")
    archs = hf_config.get("architectures") or []
    if not archs or archs[0] not in MODELS:
        return None
    return model_state_class(MODELS.get(archs[0]), hf_config, config.model.model_state)


def _model_state_reasons(config: Mrv2Config) -> list[str]:
    state_cls = configured_model_state(config)
    if state_cls is None or getattr(state_cls, "supports_v2", True):
        return []
    return [
        f"model state '{state_cls.name}' ({state_cls.__module__}.{state_cls.__qualname__}) declares supports_v2 = False"
    ]


def v2_unsupported_reasons(config: Mrv2Config) -> list[str]:
    """Readable reasons why the V2 runner cannot serve `config` (empty when it can).

    Every reason is real: an environment V2 cannot run in, or a capability only V1 offers (module docstring).
    Reading the model's config.json can raise what loading the model would (`CheckpointError`).
    """
    return triton_reasons(config.device) + _model_state_reasons(config)


def check_speculator(config: Mrv2Config) -> None:
    """`speculator.method` must name a registered speculator."""
    from framework.config.registry import SPECULATORS

    method = config.speculator.method
    if method != "none" and method not in SPECULATORS:
        raise ConfigError(
            f"speculator.method={method}: unknown speculator; registered: {', '.join(SPECULATORS.names())}"
        )


def select_runner(config: Mrv2Config) -> str:
    """`runner.kind` resolved to "v2" or "v1"; raises `ConfigError` when the choice cannot run.

    `auto` picks V2 unless `v2_unsupported_reasons` lists something, then V1 with one warning naming the
    reasons; `v2` with reasons fails with them (never a silent downgrade); `v1` always uses V1.
    """
    check_speculator(config)
    kind = config.runner.kind
    speculating = config.speculator.method != "none"
    if kind == "v1" and speculating:
        raise ConfigError(
            f"speculator.method={config.speculator.method}: the V1 runner does not verify drafts "
            "(speculative decoding needs the V2 runner: runner=v2 or runner=auto)"
        )
    if kind == "v1":
        return "v1"
    reasons = v2_unsupported_reasons(config)
    if not reasons:
        return "v2"
    if speculating:
        raise ConfigError(
            "speculative decoding needs the V2 runner, which cannot serve this config: " + "; ".join(reasons)
        )
    if kind == "v2":
        raise ConfigError(
            "runner=v2 cannot serve this config: " + "; ".join(reasons) + " (use runner=v1 or runner=auto)"
        )
    logger.warning("runner=auto uses the V1 runner because V2 cannot serve this config: %s", "; ".join(reasons))
    return "v1"
