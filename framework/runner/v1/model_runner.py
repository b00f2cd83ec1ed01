"""Model Runner V1: a persistent batch whose rows move, inputs built on the CPU, synchronous sampling.

The fallback for configs V2 cannot serve, and the baseline V2 is measured against. Read `execute_model` and
`sample_tokens` top to bottom; docs/runners.md compares the two runners step by step. Like V2 it replays
captured CUDA graphs for decode batches (`framework.runner.graphs.cuda_graphs`) and samples with V2's fused path
(`samplers.fused_sampling.sample_fused`) from per-slot parameter tables, whenever Triton runs on the device.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional

import numpy as np
import torch

from framework.batch.input_batch import InputBatch
from framework.config.schema import Mrv2Config
from framework.layers.attention import AttentionMetadata
from framework.layers.kernels.triton_support import triton_reasons
from framework.models.loaded import LoadedModel
from framework.params.request_errors import RequestStepError, SlotWriteError
from framework.params.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from framework.runner.async_output import AsyncOutput
from framework.runner.graphs.cuda_graphs import DecodeCudaGraphs, GraphCapturer, capture_sizes
from framework.runner.interface import ModelRunner
from framework.runner.plugins import ModelState, build_model_state
from framework.runner.pooling import PooledRows, PoolingState, hidden_size_of
from framework.runner.v1.inputs import HostToDevice, StepInputs, build_step_inputs
from framework.runner.v1.persistent_batch import PersistentBatch
from samplers.fused_sampling import sample_fused
from samplers.sampler import ROW_NO_TOKEN_LEFT, ROW_NONFINITE_LOGITS
from samplers.states import SamplingParamsState

logger = logging.getLogger(__name__)


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
    ModelState that works under V2 works here unchanged; the hooks see batch-ordered tensors as in V2. The
    sampling parameters live in those slots too (`SamplingParamsState`, written once per request), so the
    sampler reads them through `idx_mapping` as V2's does, and nothing of them moves or is copied per step.
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
        self.model_state = build_model_state(
            self.model, loaded.hf_config, config.model.model_state, max_reqs, self.device
        )
        self.config = config
        self.prefix_cache_hooks = self._prefix_cache_hooks_of(self.model_state)  # state snapshots, before KV sizing
        self.pooling_state = PoolingState(max_reqs, hidden_size_of(loaded), self.device)  # keyed by state_slot too
        self.sampling_params = SamplingParamsState(max_reqs, self.device)  # keyed by state_slot too
        # V2's fused sampler and CUDA graphs (Triton attention) need Triton on the device; without it (the
        # reason `auto` picked V1) the reference sampler and eager forwards run.
        self.triton_on_device = self.device.type == "cuda" and not triton_reasons(config.device)
        self.cuda_graphs: Optional[DecodeCudaGraphs] = None
        self.eager_forwards = 0  # forwards that ran eagerly (no captured graph fits): benchmarks report them
        # Benchmarks set this to a list to collect (start, end) CUDA events around each step's device work.
        self.step_events: Optional[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = None
        self._free_state_slots = list(range(max_reqs - 1, -1, -1))  # pop() hands out slot 0 first
        self.loaded = loaded
        self.kv_caches: list[torch.Tensor] = []  # allocated by initialize_kv_cache after the profiling run
        self._to_device = HostToDevice(self.device)
        self._pending: Optional[_ExecuteState] = None

    def initialize_kv_cache(self, num_blocks: int) -> None:
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.loaded.kv_dtype, device=self.device) for _ in range(self.model.num_kv_layers)
        ]

    def capture_cuda_graphs(self, capturer: Optional[GraphCapturer] = None) -> None:
        """Capture decode graphs (`runner.cuda_graphs`, Triton on a GPU); call after the KV cache exists.
        `capturer` replaces CUDA graph capture (CPU tests replay by running the captured step again)."""
        rc = self.config.runner
        if not (rc.cuda_graphs and (self.triton_on_device or capturer is not None)):
            return
        state = self.model_state
        reason = state.cuda_graph_unsupported_reason() or self.model.cuda_graph_unsupported_reason()
        if reason is None and type(state).prepare_graph_inputs is not ModelState.prepare_graph_inputs:
            # V1's rows move between steps, and its slots are its own: it feeds no per-slot state to a graph.
            reason = f"the V1 runner replays no graph with per-slot inputs (model state '{state.name}')"
        if reason is not None:
            logger.info("V1 decode runs without CUDA graphs: %s", reason)
            return
        max_reqs = self.config.scheduler.max_num_seqs
        sizes = capture_sizes(rc.cuda_graph_sizes, max_reqs)
        self.cuda_graphs = DecodeCudaGraphs(
            self.model,
            self.kv_caches,
            sizes,
            self.batch.max_blocks_per_req,
            self.block_size,
            self.loaded.max_model_len,
            self.device,
            capturer=capturer,
        )
        self.cuda_graphs.capture()

    def release_cuda_graphs(self) -> None:
        self.cuda_graphs = None
        super().release_cuda_graphs()

    # ---- execute_model ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> None:
        if any(output.num_draft_tokens):
            raise NotImplementedError("the V1 runner does not verify draft tokens")
        if self.step_events is not None and self.device.type == "cuda":
            self.step_events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.step_events[-1][0].record()
        self._remove_requests(output.finished_request_ids)  # 1. rows of finished / preempted requests: holes
        self._add_requests(output.new_requests)  # 2. new and resumed requests fill holes, then append
        self._update_requests(output.cached_requests)  # 3. running requests gain KV blocks
        self.batch.condense()  # 4. the last rows move into the holes
        self.batch.reorder(output.scheduled_request_ids)  # 5. rows swap into the scheduler's order
        self._apply_staged_writes()  # 6.
        if output.is_empty:
            self._pending = None
            return
        step = build_step_inputs(self.batch, output.num_scheduled_tokens, self.block_size, self._to_device)  # 7. CPU
        attn_metadata = self.model_state.prepare_attn_metadata(step.batch, step.block_tables)  # 8.
        self.model_state.save_snapshots(output.state_snapshots)  # 9. (with the state snapshots this step stores)
        extra_inputs = self.model_state.prepare_inputs(step.batch)
        batch = step.batch
        hidden = self._forward(batch, attn_metadata, extra_inputs)  # 10. graph replay or eager
        pooled = self.pooling_state.apply(
            batch, hidden, np.asarray(output.num_scheduled_tokens), step.seq_lens_host
        )  # 11. embedding requests
        self._pending = _ExecuteState(step, hidden, pooled)

    def _forward(self, batch: InputBatch, attn_metadata: AttentionMetadata, extra_inputs: dict) -> torch.Tensor:
        """hidden [T, hidden]: a captured graph for a pure decode batch (one token per row) that fits, else eager."""
        graphs = self.cuda_graphs
        pure_decode = batch.num_tokens == batch.num_rows and not extra_inputs
        size = graphs.padded_size(batch.num_rows) if graphs is not None and pure_decode else None
        if size is not None:
            return graphs.run(size, batch.input_ids, batch.positions, attn_metadata)  # type: ignore[union-attr]
        self.eager_forwards += 1
        return self.model(batch.input_ids, batch.positions, self.kv_caches, attn_metadata, **extra_inputs)

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
            try:  # an owner refusing one request's values names that request (the engine ends it alone)
                self.model_state.add_request(state_slot, new)
                self.pooling_state.add_request(state_slot, new)
                self.sampling_params.add_request(state_slot, new.sampling_params, new.sampling_seed)
            except Exception as err:
                raise RequestStepError(new.request_id, err) from err

    def _apply_staged_writes(self) -> None:
        try:  # a write that fails on one slot's values names the request holding that state slot
            self.model_state.apply_staged_writes()
            self.pooling_state.apply_staged_writes()
            self.sampling_params.apply_staged_writes()
        except SlotWriteError as err:
            rows = self.batch.req_id_to_row
            owner = next((rid for rid, row in rows.items() if self.batch.state_slot[row] == err.req_slot), None)
            if owner is None:
                raise
            raise RequestStepError(owner, err.cause) from err

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
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # 1. [R, vocab] model dtype
            stages = self.sampling_params.stages_for(batch.idx_mapping_host, logits.shape[1])
            sampled, errors = sample_fused(  # 2. V2's steps 1, 8-12, parameters read by state_slot
                logits,
                batch.expanded_idx_mapping,
                batch.sample_positions,
                self.sampling_params.slot_params,
                fused=self.triton_on_device,
                any_random=stages.any_random,
                need_plan=stages.any_top_k or stages.any_top_p or stages.any_min_p,
                all_gather=stages.all_gather,
                nonfinite_code=ROW_NONFINITE_LOGITS,
                no_token_code=ROW_NO_TOKEN_LEFT,
            )
        if self.step_events is not None and self.device.type == "cuda":
            self.step_events[-1][1].record()
        if pooled is not None:  # lands by the wait below (same stream)
            pooled = pooled._replace(vectors=pooled.vectors.to("cpu", non_blocking=True))
        host = torch.stack([sampled, errors.long()], dim=1).cpu()  # 3. the step's one wait for the device
        sampled_host, errors_host = host[:, 0].numpy(), host[:, 1].int()
        num_sampled = self.batch.append_sampled(step.seq_lens_host, sampled_host)  # 4. history grows on the CPU
        num_sampled_dev = self._to_device("num_sampled", num_sampled, np.int32)
        self.model_state.postprocess(batch, num_sampled_dev, torch.zeros_like(num_sampled_dev))  # 5.
        return AsyncOutput(
            batch.request_ids,
            torch.from_numpy(sampled_host).view(-1, 1),
            torch.from_numpy(num_sampled),
            errors=errors_host,
            pooled=pooled,
        )  # 6. already on the host
