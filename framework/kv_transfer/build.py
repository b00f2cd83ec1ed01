"""Which KV connector a config selects, built by name from `KV_CONNECTORS`, and what it cannot serve."""

from __future__ import annotations

from typing import Sequence

import torch

from framework.config.base import ConfigError
from framework.config.registry import KV_CONNECTORS, RegistryError
from framework.config.schema import CacheConfig, Mrv2Config
from framework.kv_transfer.interface import KVConnector, KVConnectorContext, NoKVConnector
from framework.params.prefix_cache import PrefixCacheHooks


def kv_connector_name(cache: CacheConfig) -> str:
    """`cache.kv_connector`, or 'host' when `cache.host_kv_gib > 0`, else 'none'."""
    if cache.kv_connector is not None:
        return cache.kv_connector
    return "host" if cache.host_kv_gib > 0 else "none"


def build_kv_connector(context: KVConnectorContext) -> KVConnector:
    """The selected connector's `context.role` side (`NoKVConnector` for 'none')."""
    name = kv_connector_name(context.cache)
    if name == "none":
        return NoKVConnector(context)
    return _connector_class(name)(context)


def check_kv_connector(
    config: Mrv2Config, runner_kind: str, prefix_caching: bool, hooks: PrefixCacheHooks, state_name: str
) -> None:
    """`ConfigError` naming why a selected KV connector cannot run here (nothing when none is selected)."""
    name = kv_connector_name(config.cache)
    if name == "none":
        return
    what = f"cache.kv_connector '{name}'" + (
        f" (cache.host_kv_gib={config.cache.host_kv_gib:g})" if name == "host" else ""
    )
    if config.parallel.world_size > 1:
        raise ConfigError(f"{what}: KV connectors run with one rank; set parallel sizes to 1 or the connector off")
    if runner_kind != "v2":
        raise ConfigError(f"{what}: KV connectors need the V2 runner, but the config selects {runner_kind}")
    if not prefix_caching:
        raise ConfigError(f"{what}: the tier indexes blocks by their prefix-cache hashes: enable prefix caching")
    if hooks.takes_snapshots and not _connector_class(name).carries_state_snapshots:
        raise ConfigError(
            f"{what}: model state '{state_name}' keeps recurrent-state snapshots on the device at cached block "
            "boundaries, and this connector does not carry them (carries_state_snapshots is False): a block "
            "loaded from it would have no state to resume from. Use a connector that does, such as 'host'"
        )


def _connector_class(name: str) -> type[KVConnector]:
    cls = KV_CONNECTORS.get(name)
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise RegistryError(f"KV connector '{name}' is {cls!r}, not a KVConnector subclass")
    return cls


def snapshot_bytes(snapshots: Sequence[torch.Tensor]) -> int:
    """The bytes of one snapshot: one row (snapshot slot) of every tensor `ModelState.snapshot_tensors` returns."""
    return sum(tensor[0].numel() * tensor.element_size() for tensor in snapshots)


def block_dim(shape_one: tuple[int, ...], shape_two: tuple[int, ...]) -> int:
    """The dimension that indexes blocks in a layer's KV cache, from its shapes for one and for two blocks."""
    dims = [d for d, (a, b) in enumerate(zip(shape_one, shape_two)) if a != b]
    if len(dims) != 1:
        raise ValueError(f"KV cache shapes {shape_one} and {shape_two} do not differ in exactly one dimension")
    return dims[0]
