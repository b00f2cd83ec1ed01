"""Which sliding window the KV cache manager may free blocks behind (`KVCacheManager.window`)."""

from __future__ import annotations

from typing import Any

from framework.config.schema import Mrv2Config


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
