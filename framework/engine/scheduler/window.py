"""Which sliding window the KV cache manager may free blocks behind (`KVCacheManager.window`), and the manager a
run gets: one block list per request, or one per KV group (`GroupedKVCacheManager`)."""

from __future__ import annotations

from typing import Any, Optional

from framework.config.schema import Mrv2Config
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.kv_groups import GroupedKVCacheManager
from framework.params.prefix_cache import PrefixCacheHooks


def freeable_window(config: Mrv2Config, model: Any, num_draft_kv_layers: int) -> int:
    """The window every attention layer of `model` reads through (the smallest, when they differ), or 0 (nothing
    freed): some layer attends fully (gpt-oss's full layers read every block, and the blocks are shared by all
    layers), `cache.free_window_blocks` is off, or a draft model with its own KV layers (EAGLE, MTP) attends
    fully over the same blocks."""
    cfg = getattr(model, "config", None)
    layer_window = getattr(cfg, "layer_window", None)
    if not config.cache.free_window_blocks or num_draft_kv_layers or layer_window is None:
        return 0
    windows = [int(layer_window(layer)) for layer in range(int(getattr(cfg, "num_layers", 0)))]
    return min(windows) if windows and min(windows) > 0 else 0


def build_kv_cache_manager(
    config: Mrv2Config,
    runner: Any,
    model: Any,
    num_blocks: int,
    prefix_caching: bool,
    hooks: Optional[PrefixCacheHooks],
) -> KVCacheManager:
    """The grouped manager when the runner's block tables are per KV group (`runner.kv_groups`), else one list
    per request that frees behind `freeable_window`."""
    groups = getattr(runner, "kv_groups", None)
    if groups is not None:
        return GroupedKVCacheManager(num_blocks, config.cache.block_size, groups.group_windows, prefix_caching, hooks)
    window = freeable_window(config, model, runner.num_draft_kv_layers)
    return KVCacheManager(num_blocks, config.cache.block_size, prefix_caching, hooks, window)
