"""Decoder-only models: no per-slot state beyond what the runner already owns."""

from __future__ import annotations

from framework.batch.block_tables import BlockTables
from framework.batch.input_batch import InputBatch
from framework.layers.attention import AttentionMetadata
from model_states.interface import ModelState


class DefaultModelState(ModelState):
    """Paged self-attention only: gathers block tables and KV slots for the batch."""

    name = "default"
    supports_prefix_caching = True  # no per-slot state: the KV blocks are everything a cached prefix needs
    full_step_graphs = True  # no hook does anything in a decode step: the full-step graph builds the same metadata

    def prepare_attn_metadata(self, batch: InputBatch, block_tables: BlockTables) -> AttentionMetadata:
        table = block_tables.gather(batch.idx_mapping)
        return AttentionMetadata(
            num_tokens=batch.num_tokens,
            num_rows=batch.num_rows,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_tables=table,
            kv_slot_mapping=block_tables.kv_slot_mapping(batch.token_rows, batch.positions, table),
            block_size=block_tables.block_size,
            max_query_len=batch.max_query_len,
            max_seq_len=batch.max_seq_len,
        )
