"""Paged attention: metadata, the PyTorch references, and the backend dispatch (Triton on CUDA)."""

from framework.layers.attention.backend import attention_backend, paged_attention, store_kv
from framework.layers.attention.metadata import NO_KV_WAITS, AttentionMetadata, KVLayerWaits
from framework.layers.attention.paged import paged_attention_reference, store_kv_reference

__all__ = [
    "AttentionMetadata",
    "KVLayerWaits",
    "NO_KV_WAITS",
    "attention_backend",
    "paged_attention",
    "paged_attention_reference",
    "store_kv",
    "store_kv_reference",
]
