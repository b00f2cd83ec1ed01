"""Model Runner V1: a persistent batch whose rows move, inputs built on the CPU, synchronous sampling.

The fallback for configs V2 cannot serve, and the baseline V2 is measured against. Read `execute_model` and
`sample_tokens` top to bottom; docs/runners.md compares the two runners step by step.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from framework.async_output import AsyncOutput
from framework.config import Mrv2Config
from framework.engine_setup import LoadedModel
from framework.plugins import build_model_state
from framework.pooling import PooledRows, PoolingState, hidden_size_of
from framework.runner_interface import ModelRunner
from framework.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from framework.v1.inputs import HostToDevice, StepInputs, build_step_inputs
from framework.v1.persistent_batch import PersistentBatch
from framework.v1.sampling import sample_rows
from samplers.sampler import ROW_NONFINITE_LOGITS


class _ExecuteState(NamedTuple):
    """What `execute_model` hands to `sample_tokens`."""

    step: StepInputs
    hidden_states: torch.Tensor  # [T, hidden]
    pooled: Optional[PooledRows]  # vectors of embedding requests whose prompt completed this step


class ModelRunnerV1(ModelRunner):
    """The V1 runner: the `PersistentBatch` owns every per-request array, one row per request.

    The ModelState keeps V2's contract: its per-request state lives in a stable slot that V1 hands out from
    its own free list and carries as the `state_slot` column of the batch (that column moves with the row),
    so `InputBatch.idx_mapping` maps batch rows to those slots and no ModelState state ever moves. Any
    ModelState that works under V2 works here unchanged; the hooks see batch-ordered tensors as in V2.
    """

    name = "v1"

    def __init__(self, config: Mrv2Config, loaded: LoadedModel) -> None:
        if config.speculator.method != "none":
            raise NotImplementedError("the V1 runner does not verify draft tokens")
        self.device = loaded.device
        self.model = loaded.model
        max_reqs = config.scheduler.max_num_seqs
        self.block_size = config.cache.block_size
        self.batch = PersistentBatch(max_reqs, loaded.max_model_len, -(-loaded.max_model_len // self.block_size))
        self.model_state = build_model_state(self.model, loaded.hf_config, config.model.model_state, max_reqs,
                                             self.device)
        self.config = config
        self.prefix_cache_hooks = self._prefix_cache_hooks_of(self.model_state)  # state snapshots, before KV sizing
        self.pooling_state = PoolingState(max_reqs, hidden_size_of(loaded), self.device)  # keyed by state_slot too
        self._free_state_slots = list(range(max_reqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.config, self.loaded = config, loaded
        self.kv_caches: list[torch.Tensor] = []  # allocated by initialize_kv_cache after the profiling run
        self._to_device = HostToDevice(self.device)
        self._pending: Optional[_ExecuteState] = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [torch.zeros(shape, dtype=self.loaded.dtype, device=self.device)
                          for _ in range(self.model.num_kv_layers)]

    # ---- execute_model ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> None:
        if any(output.num_draft_tokens):
            raise NotImplementedError("the V1 runner does not verify draft tokens")
        self._remove_requests(output.finished_request_ids)  # 1. rows of finished / preempted requests: holes
        self._add_requests(output.new_requests)  # 2. new and resumed requests fill holes, then append
        self._update_requests(output.cached_requests)  # 3. running requests gain KV blocks
        self.batch.condense()  # 4. the last rows move into the holes
        self.batch.reorder(output.scheduled_request_ids)  # 5. rows swap into the scheduler's order
        self.model_state.apply_staged_writes()  # 6.
        self.pooling_state.apply_staged_writes()
        if output.is_empty:
            self._pending = None
            return
        step = build_step_inputs(self.batch, output.num_scheduled_tokens, self.block_size, self._to_device)  # 7. CPU
        attn_metadata = self.model_state.prepare_attn_metadata(step.batch, step.block_tables)  # 8.
        self.model_state.save_snapshots(output.state_snapshots)  # 9. (with the state snapshots this step stores)
        extra_inputs = self.model_state.prepare_inputs(step.batch)
        batch = step.batch
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, attn_metadata, **extra_inputs)  # 10.
        pooled = self.pooling_state.apply(batch, hidden, np.asarray(output.num_scheduled_tokens),
                                          step.seq_lens_host)  # 11. embedding requests
        self._pending = _ExecuteState(step, hidden, pooled)

    def _remove_requests(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            state_slot = self.batch.remove_request(request_id)
            if state_slot is not None:
                self.model_state.remove_request(state_slot)
                self.pooling_state.remove_request(state_slot)
                self._free_state_slots.append(state_slot)

    def _add_requests(self, new_requests: list[NewRequestData]) -> None:
        for new in new_requests:
            state_slot = self._free_state_slots.pop()
            self.batch.add_request(new, state_slot)
            self.model_state.add_request(state_slot, new)
            self.pooling_state.add_request(state_slot, new)

    def _update_requests(self, cached: list[CachedRequestData]) -> None:
        for data in cached:
            if data.new_block_ids:
                self.batch.append_blocks(self.batch.req_id_to_row[data.request_id], data.new_block_ids)

    # ---- sample_tokens ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self) -> AsyncOutput:
        if self._pending is None:
            return AsyncOutput.empty()
        step, hidden, pooled = self._pending
        self._pending = None
        batch = step.batch
        if self.pooling_state.only_pooling(batch.idx_mapping_host):  # 1-2. embeddings only: nothing to sample
            sampled = torch.zeros(batch.num_rows, dtype=torch.int64, device=self.device)
            errors = torch.zeros(batch.num_rows, dtype=torch.int32, device=self.device)
        else:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # 1. [R, vocab] float32
            sampled = sample_rows(logits, self.batch, batch.sample_positions, self._to_device)  # 2. from the rows
            # Rows with NaN or +inf logits are reported (finish_reason "error"), as V2's sampler does; -inf masks.
            errors = (torch.isnan(logits) | (logits == float("inf"))).any(dim=-1).int() * ROW_NONFINITE_LOGITS
        sampled_host = sampled.cpu().numpy()  # 3. wait for the device: V1 is synchronous
        num_sampled = self.batch.append_sampled(step.seq_lens_host, sampled_host)  # 4. history grows on the CPU
        num_sampled_dev = torch.from_numpy(num_sampled).to(self.device)
        self.model_state.postprocess(batch, num_sampled_dev, torch.zeros_like(num_sampled_dev))  # 5.
        return AsyncOutput(batch.request_ids, torch.from_numpy(sampled_host).view(-1, 1),
                           torch.from_numpy(num_sampled), errors=errors, pooled=pooled)  # 6. already on the host
