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


def select_runner(config: Mrv2Config) -> str:
    """`runner.kind` resolved to "v2" or "v1"; raises :class:`ConfigError` when the choice cannot run."""
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
