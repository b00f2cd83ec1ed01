"""Runner selection: which features of a config V2 does not support, and which runner to use."""

from __future__ import annotations

import logging

from framework.config import ConfigError, Mrv2Config

logger = logging.getLogger(__name__)


def v2_unsupported_reasons(config: Mrv2Config) -> list[str]:
    """Readable reasons why the V2 runner cannot serve `config` (empty when it can).

    Every reason must be real: a feature V1 has that V2 lacks, or an environment V2 cannot run in.
    Today V2 serves everything the engine offers, so the list is empty; the V1 issue adds reasons together
    with the V1 features behind them.
    """
    return []


def check_speculator(config: Mrv2Config) -> None:
    """`speculator.method` must name a registered speculator; drafts need the rejection sampler (planned)."""
    from framework.registry import SPECULATORS

    method = config.speculator.method
    if method == "none":
        return
    if method not in SPECULATORS:
        raise ConfigError(
            f"speculator.method={method}: unknown speculator; registered: {', '.join(SPECULATORS.names()) or 'none yet'}"
        )
    raise ConfigError(f"speculator.method={method}: draft verification (the rejection sampler) is not available yet")


def select_runner(config: Mrv2Config) -> str:
    """`runner.kind` resolved to "v2" or "v1"; raises `ConfigError` when the choice cannot run."""
    check_speculator(config)
    reasons = v2_unsupported_reasons(config)
    kind = config.runner.kind
    if kind == "v2" and reasons:
        raise ConfigError("runner=v2 cannot serve this config: " + "; ".join(reasons))
    if kind == "auto":
        if not reasons:
            return "v2"
        logger.warning("runner=auto falls back to V1 because: %s", "; ".join(reasons))
        kind = "v1"
    if kind == "v1":
        raise ConfigError("runner=v1 is not available yet (the V1 fallback runner is a planned feature); "
                          "use runner=v2 or runner=auto")
    return kind
