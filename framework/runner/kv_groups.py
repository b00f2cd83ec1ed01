"""Whether a run splits its KV cache into groups (`framework.params.kv_groups`), and the KV tensors it allocates."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from framework.batch.block_tables import BlockTables
from framework.batch.group_block_tables import GroupedBlockTables
from framework.config.schema import Mrv2Config
from framework.kv_transfer.build import kv_connector_name
from framework.params.kv_groups import KVGroupLayout, kv_group_layout

logger = logging.getLogger(__name__)


def choose_kv_groups(config: Mrv2Config, model: Any, num_draft_kv_layers: int) -> Optional[KVGroupLayout]:
    """The KV groups of this run, or None (one table for every layer): `cache.kv_groups` is on and the model
    (a Llama-family forward, which hands each layer its group's metadata) mixes full and window layers. Runs the
    groups do not serve yet keep one table, with one log line saying why."""
    cfg = getattr(model, "config", None)
    layer_window = getattr(cfg, "layer_window", None)
    if not config.cache.kv_groups or not hasattr(model, "kv_groups") or layer_window is None:
        return None
    kv_layer_windows = getattr(model, "kv_layer_windows", None)  # a model with fewer KV caches than layers (Gemma 4)
    if kv_layer_windows is not None:
        windows = [int(w) for w in kv_layer_windows()]
    else:
        windows = [int(layer_window(i)) for i in range(int(cfg.num_layers))]  # type: ignore[union-attr]
    layout = kv_group_layout(windows)
    if layout is None:
        return None
    reason = _unsupported_reason(config, num_draft_kv_layers)
    if reason is not None:
        logger.info("cache.kv_groups: one block table for every layer (%s)", reason)
        return None
    return layout


def _unsupported_reason(config: Mrv2Config, num_draft_kv_layers: int) -> Optional[str]:
    if config.parallel.pipeline_parallel_size > 1:  # a stage holds some layers; the layout indexes global ones
        return "pipeline parallelism"
    if num_draft_kv_layers:
        return "a draft model with its own KV layers (EAGLE, MTP)"
    if kv_connector_name(config.cache) != "none":
        return "a KV connector (its transfers move one block id per block)"
    if config.serve.kv_events.enabled:
        return "KV-cache events (published per block of the one table)"
    return None


def build_block_tables(
    max_num_reqs: int, max_blocks_per_req: int, block_size: int, device: torch.device, layout: Optional[KVGroupLayout]
) -> BlockTables:
    """The runner's block-table owner: one table, or one per KV group side by side."""
    if layout is None:
        return BlockTables(max_num_reqs, max_blocks_per_req, block_size, device)
    return GroupedBlockTables(max_num_reqs, max_blocks_per_req, block_size, device, layout)


def allocate_kv_caches(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, num_layers: int, layout: Optional[KVGroupLayout]
) -> list[torch.Tensor]:
    """One KV tensor of `shape` per layer, or with groups `layout.num_tensors` tensors, layer `i` reading
    `layout.layer_tensor[i]` (the list still has one entry per layer, so the model indexes it as before)."""
    if layout is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_tensors)]
    return [tensors[layout.layer_tensor[i]] for i in range(num_layers)]
