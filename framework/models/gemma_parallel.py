"""What Gemma 3 / Gemma 4 refuse under parallelism, by name, before any weight is allocated.

Tensor parallelism splits every layer kind's attention heads and KV heads (each kind its own geometry in Gemma 4),
so each count must divide by the tensor-parallel size; the launcher checks `num_key_value_heads` only, not Gemma
4's full layers' `num_global_key_value_heads`. Pipeline parallelism is not served: Gemma 4's KV-shared layers read
the cache of an earlier layer, which may sit on another stage, and its per-layer inputs are computed from the
embedding on the first stage.
"""

from __future__ import annotations

from framework.layers.parallel.context import ParallelContext
from framework.models.hf_config import UnsupportedModelError


def check_gemma_parallel(family: str, ctx: ParallelContext, heads: dict[str, int]) -> None:
    """Refuse `ctx` for `family` (e.g. "Gemma 4") when it has pipeline stages, or when a head count of `heads`
    (config key -> value) does not divide by its tensor-parallel size."""
    if ctx.pp_size > 1:
        raise UnsupportedModelError(
            f"{family} does not run under pipeline parallelism (parallel.pipeline_parallel_size={ctx.pp_size}); "
            "use parallel.pipeline_parallel_size=1 (tensor parallelism is supported)"
        )
    bad = [f"{key}={n}" for key, n in heads.items() if n % ctx.tp_size]
    if bad:
        raise UnsupportedModelError(
            f"{family}: {', '.join(bad)} {'does' if len(bad) == 1 else 'do'} not divide by "
            f"parallel.tensor_parallel_size={ctx.tp_size} "
            "(heads are split over the tensor ranks, not replicated)"
        )
