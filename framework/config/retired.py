"""Keys that config files and command lines may still carry but the schema no longer has.

Each maps its old dotted key to what replaced it, so that an old config fails with one line that says where the
setting went (or that it is gone), not with pydantic's generic "extra inputs are not permitted".
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from framework.config.base import ConfigError

# old dotted key -> the new key (a dotted key of the schema) or, for a removed setting, why it went
RETIRED_KEYS: dict[str, str] = {
    "model.small_batch_kernels": "kernels.small_batch",
    "model.programmatic_launch": "kernels.programmatic_launch",
    "model.longest_rows_first": "kernels.longest_rows_first",
    "model.small_batch_max_tokens": "removed: the small-batch GEMV kernels take one-token forwards only (the "
    "tensor-core kernel for 2-16 rows lost to cuBLAS on the H200 and is gone)",
    "sampler.structured_outputs_backend": "removed: llguidance is the only grammar library",
}


def retired_message(dotted: str) -> Optional[str]:
    """The error line for a retired key; None for a key that is not retired."""
    target = RETIRED_KEYS.get(dotted)
    if target is None:
        return None
    if target.startswith("removed:"):
        return f"{dotted}: {target}"
    return f"{dotted}: moved to {target} (set {target}=... instead)"


def check_retired(data: Mapping[str, Any]) -> None:
    """Raise `ConfigError` naming every retired key present in the nested mapping `data`."""
    lines = []
    for dotted in RETIRED_KEYS:
        node: Any = data
        for part in dotted.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            lines.append(retired_message(dotted))
    if lines:
        raise ConfigError("invalid config:\n  " + "\n  ".join(str(line) for line in lines))
