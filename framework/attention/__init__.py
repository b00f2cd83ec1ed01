"""Paged attention: metadata and the reference backend."""

from framework.attention.metadata import AttentionMetadata
from framework.attention.paged import paged_attention_reference, store_kv_reference

__all__ = ["AttentionMetadata", "paged_attention_reference", "store_kv_reference"]
