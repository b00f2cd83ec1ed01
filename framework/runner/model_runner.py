"""Model Runner V2: stable request slots, inputs prepared on the device, results copied asynchronously.

Read `execute_model` and `sample_tokens` top to bottom: each is a numbered list of calls.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from framework.batch.input_batch import InputBatch, batch_req_slots, build_input_batch, input_staging
from framework.batch.request_state import RequestState
from framework.config.schema import Mrv2Config
from framework.kv_transfer.build import block_dim, build_kv_connector, snapshot_bytes
from framework.kv_transfer.interface import KVConnector, KVConnectorContext, NoKVConnector
from framework.layers.attention import AttentionMetadata
from framework.layers.kernels.input_prep import compute_num_sampled, post_update
from framework.models.loaded import LoadedModel
from framework.models.setup import kv_bytes_per_block
from framework.params.kv_transfer import KVConnectorMetadata, KVConnectorOutput, KVTierStats
from framework.params.request_errors import RequestStepError, SlotWriteError
from framework.params.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from framework.runner.async_output import AsyncOutput
from framework.runner.draft_verify import DraftVerifier
from framework.runner.grammar import GrammarHandoff
from framework.runner.graphs.cuda_graphs import GraphCapturer
from framework.runner.graphs.runner_graphs import RunnerGraphs
from framework.runner.graphs.step_graphs import FullStepResult
from framework.runner.interface import ModelRunner
from framework.runner.kv_groups import allocate_kv_caches, build_block_tables, choose_kv_groups
from framework.runner.logits_processors import build_logits_processors
from framework.runner.lora_state import build_lora_state
from framework.runner.output_copy import OutputCopies, logits_row_starts
from framework.runner.plugins import ProposeInputs, Speculator, build_model_state, build_speculator
from framework.runner.pooling import PooledRows, PoolingState, hidden_size_of
from samplers.sampler import Sampler, SamplerOutput
from samplers.states import SamplingStates
from samplers.structured.backend import GuidanceBackend
from samplers.structured.state import StructuredOutputsState

logger = logging.getLogger(__name__)


class _ExecuteState(NamedTuple):
    """What `execute_model` hands to `sample_tokens`."""

    batch: InputBatch
    hidden_states: torch.Tensor  # [T, hidden]
    pooled: Optional[PooledRows]  # vectors of embedding requests whose prompt completed this step
    num_propose: int  # drafts per row the speculator proposes after this step (SchedulerOutput.num_propose_tokens)
    aux_hidden_states: tuple[torch.Tensor, ...]  # [T, hidden] each: target layers the speculator reads
    attn_metadata: Optional[AttentionMetadata]  # kept for a draft model's KV writes (same KV slots)


class ModelRunnerV2(ModelRunner):
    """The V2 runner. Per-slot owners: RequestState, BlockTables, SamplingStates, the ModelState and the
    Speculator (if any); each has add_request / remove_request / apply_staged_writes."""

    name = "v2"

    def __init__(self, config: Mrv2Config, loaded: LoadedModel) -> None:
        self.device = loaded.device
        self.model = loaded.model
        self.parallel = loaded.parallel  # under TP/PP: every rank runs this runner on the same scheduler outputs
        max_reqs = config.scheduler.max_num_seqs
        bs = config.cache.block_size
        on_host = config.cache.token_history_on_host
        self.request_state = RequestState(
            max_reqs,
            loaded.max_model_len,
            config.speculator.num_speculative_tokens,
            self.device,
            history_on_host=self.device.type == "cuda" if on_host is None else on_host,
        )
        vocab_size = loaded.vocab_size
        k_max = config.speculator.num_speculative_tokens
        self.grammar_backend = GuidanceBackend(loaded.tokenizer, vocab_size, loaded.eos_token_id)
        self.outputs = OutputCopies(max_reqs, k_max, self.device)  # the D2H copy of each step's results
        structured = StructuredOutputsState(
            max_reqs,
            max_reqs * (k_max + 1),
            vocab_size,
            self.grammar_backend,
            self.device,
            next_output=lambda: self.outputs.num_outputs,
            fill_threads=config.sampler.structured_outputs_fill_threads,
        )
        self.sampling_states = SamplingStates(
            max_reqs,
            self.device,
            vocab_size=vocab_size,
            history=self.request_state,
            num_computed_host=lambda: self.request_state.num_computed_host,
            eos_token_id=loaded.eos_token_id,
            logits_processors=build_logits_processors(
                config.sampler.logits_processors, max_reqs, vocab_size, self.device
            ),
            structured=structured,
        )
        self.sampler = Sampler(self.sampling_states, config.sampler.logprobs_mode)
        self.model_state = build_model_state(
            self.model, loaded.hf_config, config.model.model_state, max_reqs, self.device
        )
        self.config = config
        self.prefix_cache_hooks = self._prefix_cache_hooks_of(self.model_state)  # state snapshots, before KV sizing
        self.pooling_state = PoolingState(max_reqs, hidden_size_of(loaded), self.device)
        self.lora_state = build_lora_state(config, loaded)  # adapters per slot (a no-op owner when off)
        self.speculator: Optional[Speculator] = build_speculator(config.speculator, loaded, max_reqs, self.device)
        self.num_draft_kv_layers = self.speculator.num_kv_layers if self.speculator is not None else 0
        self.kv_groups = choose_kv_groups(config, self.model, self.num_draft_kv_layers)  # None: one block table
        if self.kv_groups is not None:
            self.model.kv_groups = self.kv_groups  # each layer reads its group's table
        self.block_tables = build_block_tables(
            max_reqs, -(-loaded.max_model_len // bs), bs, self.device, self.kv_groups
        )
        self.aux_layer_ids = self.speculator.aux_hidden_layer_ids if self.speculator is not None else ()
        self.loaded = loaded
        self.kv_caches: list[torch.Tensor] = []  # allocated by initialize_kv_cache after the profiling run
        # Another tier of KV blocks (the host-memory tier): its worker side, built with the KV cache.
        self.kv_connector: KVConnector = NoKVConnector()
        self._kv_transfers: Optional[KVConnectorMetadata] = None  # this step's, for the saves after the forward
        self.graphs = RunnerGraphs(self)  # decode, full-step and prefill graphs: capture and replay decisions
        # Benchmarks set this to a list to collect (start, end) CUDA events around each step's device work.
        self.step_events: Optional[list[tuple[torch.cuda.Event, torch.cuda.Event]]] = None
        self.eager_forwards = 0  # forwards that ran eagerly (no captured graph fits): benchmarks report them
        self.input_staging = input_staging(max_reqs, self.device)  # a step's per-row arrays: one H2D copy
        self._pending: Optional[Union[_ExecuteState, FullStepResult]] = None
        self.drafts = DraftVerifier(self.request_state, self.sampling_states, self.device)
        # Structured outputs: the last output the grammar matchers have not consumed, and the drafts proposed with it.
        self.grammar = GrammarHandoff(self.sampling_states, self.request_state, self.outputs.copy_stream)

    # ---- start-up ----------------------------------------------------------------------------------------
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's paged KV cache (`num_blocks` blocks of `cache.block_size` tokens)."""
        shape = self.model.kv_cache_shape(num_blocks, self.config.cache.block_size)
        self.kv_caches = allocate_kv_caches(
            shape, self.loaded.kv_dtype, self.device, self.model.num_kv_layers, self.kv_groups
        )
        draft_caches = [
            torch.zeros(shape, dtype=self.loaded.kv_dtype, device=self.device) for _ in range(self.num_draft_kv_layers)
        ]
        if self.speculator is not None:  # the draft model's own layers, same block ids and KV slots
            self.speculator.bind_kv_caches(draft_caches)
        bs = self.config.cache.block_size
        block_bytes = kv_bytes_per_block(self.loaded, bs, self.num_draft_kv_layers)
        snapshots = self.model_state.snapshot_tensors()  # recurrent-state snapshots travel with their blocks
        waits = getattr(self.model, "waits_per_kv_layer", False)  # a forward that waits per layer: layer-wise loads
        self.kv_connector = build_kv_connector(
            KVConnectorContext(
                "worker", self.config.cache, block_bytes, self.device, snapshot_bytes(snapshots), layer_waits=waits
            )
        )
        dim = block_dim(self.model.kv_cache_shape(1, bs), self.model.kv_cache_shape(2, bs))
        self.kv_connector.register_kv_caches(self.kv_caches + draft_caches, dim)
        self.kv_connector.register_state_snapshots(snapshots)

    def capture_cuda_graphs(self, capturer: Optional[GraphCapturer] = None) -> None:
        """Capture decode graphs (GPU with Triton attention, `runner.cuda_graphs`) and, when on, full-step graphs
        (`runner.full_step_cuda_graphs`) and prefill pieces, all held by `self.graphs`; call after the KV cache
        exists. `capturer` replaces CUDA graph capture (CPU tests replay by running the captured step again)."""
        not_captured = self.graphs.capture(self._forward_with_aux, capturer)
        if not_captured is not None:
            logger.info(not_captured)

    def release_cuda_graphs(self) -> None:
        self.graphs.release()
        super().release_cuda_graphs()

    # ---- execute_model ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> None:
        if self.step_events is not None and self.device.type == "cuda":
            self.step_events.append((torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
            self.step_events[-1][0].record()
        self._free_slots(output.finished_request_ids)  # 1. finished / preempted requests leave their slots
        self._add_requests(output.new_requests)  # 2. new and resumed requests take slots
        self._update_requests(output.cached_requests)  # 3. running requests gain KV blocks
        self.kv_connector.start_load_kv(output.kv_connector_metadata)  # 4a. KV tier copies start, side stream
        self.kv_connector.wait_for_state_loads()  # 4b. loaded snapshots (restored in 4); KV: per layer, in 8
        self._apply_staged_writes()  # 4. one scatter per state tensor
        self._kv_transfers = output.kv_connector_metadata
        if output.is_empty:
            self._pending = None
            return
        slots = batch_req_slots(output, self.request_state)  # 4c. batch_row -> req_slot (host)
        self.lora_state.prepare(output, slots)  # 4c'. each token's LoRA adapter slot, before any forward or replay
        # 4d. a graph-safe pure-decode step: steps 5-8 and sampling as one replay
        self._pending = self.graphs.replay_full_step(output, slots, self.outputs.copy_stream)
        if self._pending is not None:
            return
        batch = build_input_batch(
            output,
            self.request_state,
            self.device,  # 5. inputs, on the device
            self.input_staging,
            slots,
        )
        attn_metadata = self.model_state.prepare_attn_metadata(batch, self.block_tables)  # 6. block tables, KV slots
        attn_metadata = self.kv_connector.bind_layer_waits(attn_metadata)  # 6b. each layer waits for its loads
        self.model_state.save_snapshots(output.state_snapshots)  # 7. recurrent-state snapshots this step stores
        hidden, aux_hidden = self._forward(batch, attn_metadata)  # 8. state inputs, then graph replay or eager
        seq_lens_host = self.request_state.num_computed_host[batch.idx_mapping_host]
        pooled = self.pooling_state.apply(  # 9. embedding requests: pool prompt hidden states, on the device
            batch, hidden, output.num_scheduled_tokens, seq_lens_host
        )
        self._pending = _ExecuteState(
            batch,
            hidden,
            pooled,
            output.num_propose_tokens,
            aux_hidden,
            attn_metadata if self.num_draft_kv_layers else None,
        )

    def _forward(
        self, batch: InputBatch, attn_metadata: AttentionMetadata
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """(hidden [T, hidden], aux hidden states of `aux_layer_ids`): graph replay for pure decode, else eager.
        The ModelState prepares either way: `prepare_graph_step` before a replay, `prepare_inputs` before eager."""
        replayed = self.graphs.replay_forward(batch, attn_metadata)
        if replayed is not None:
            return replayed
        prefilled = self.graphs.replay_prefill(batch, attn_metadata)  # prompt steps: pieces between attentions
        if prefilled is not None:
            return prefilled, ()
        extra_inputs = self.model_state.prepare_inputs(batch)
        self.eager_forwards += 1
        if self.parallel.pp_size == 1:
            return self._forward_with_aux(
                batch.input_ids, batch.positions, self.kv_caches, attn_metadata, **extra_inputs
            )
        return self._forward_stage(batch, attn_metadata, extra_inputs), ()  # no speculation under PP (config)

    def _forward_stage(self, batch: InputBatch, attn_metadata, extra_inputs: dict) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """One pipeline stage: hidden states in from the previous stage, out to the next one."""
        ctx = self.parallel
        if not ctx.is_first_stage:
            shape = (batch.num_tokens, self.model.config.hidden_size)
            extra_inputs = {
                **extra_inputs,
                "pp_hidden": ctx.recv_from_previous_stage(shape, self.loaded.dtype, self.device),
            }
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, attn_metadata, **extra_inputs)
        if not ctx.is_last_stage:
            ctx.send_to_next_stage(hidden)
        return hidden

    def _forward_with_aux(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        **extra_inputs: torch.Tensor,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        if self.aux_layer_ids:  # the target also returns the layers a draft model reads (EAGLE-3)
            return self.model.forward_with_aux(
                input_ids, positions, kv_caches, attn_metadata, self.aux_layer_ids, **extra_inputs
            )
        return self.model(input_ids, positions, kv_caches, attn_metadata, **extra_inputs), ()

    def _states(self) -> list:
        owners = [self.block_tables, self.sampling_states, self.model_state, self.pooling_state, self.lora_state]
        return owners + ([self.speculator] if self.speculator is not None else [])

    def _free_slots(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            slot = self.request_state.remove_request(request_id)
            if slot is not None:
                for owner in self._states():
                    owner.remove_request(slot)

    def _add_requests(self, new_requests: list[NewRequestData]) -> None:
        for new in new_requests:
            slot = self.request_state.add_request(new)
            try:  # an owner refusing one request's values names that request (the engine ends it alone)
                self.block_tables.add_request(slot, new.block_ids)
                self.sampling_states.add_request(slot, new)
                self.model_state.add_request(slot, new)
                self.pooling_state.add_request(slot, new)
                self.lora_state.add_request(slot, new)
                if self.speculator is not None:
                    self.speculator.add_request(slot, new)
            except Exception as err:
                raise RequestStepError(new.request_id, err) from err

    def _update_requests(self, cached: list[CachedRequestData]) -> None:
        for data in cached:
            self.block_tables.append_blocks(self.request_state.req_id_to_slot[data.request_id], data.new_block_ids)

    def _apply_staged_writes(self) -> None:
        try:  # a write that fails on one slot's values names that slot's request (the engine ends it alone)
            self.request_state.apply_staged_writes()
            for owner in self._states():
                owner.apply_staged_writes()
        except SlotWriteError as err:
            slot_to_id = {slot: rid for rid, slot in self.request_state.req_id_to_slot.items()}
            if err.req_slot not in slot_to_id:
                raise
            raise RequestStepError(slot_to_id[err.req_slot], err.cause) from err

    # ---- sample_tokens ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def sample_tokens(self) -> AsyncOutput:
        if self._pending is None:
            return AsyncOutput.empty()
        pending, self._pending = self._pending, None
        self.kv_connector.start_save_kv(self._kv_transfers)  # the forward is queued: a tier may save its KV
        self.grammar.advance_matchers()  # 0. the last step's tokens advance the matchers (if one is constrained)
        if isinstance(pending, FullStepResult):  # 1-8 ran inside the replay: only the copy-out is left
            return self._step_done(self.outputs.start_full_step(pending))
        batch, hidden, pooled, num_propose, aux_hidden, attn_metadata = pending
        if not self.parallel.is_last_stage:  # 1-3. an earlier pipeline stage: the driver's tokens arrive below
            sampled = SamplerOutput(torch.zeros(batch.num_logits, dtype=torch.int64, device=self.device))
        elif self.pooling_state.only_pooling(batch.idx_mapping_host):  # 1-2. embeddings only: no logits, no sampler
            sampled = SamplerOutput(torch.zeros(batch.num_logits, dtype=torch.int64, device=self.device))
        else:
            stages = self.sampling_states.stages_for(batch.idx_mapping_host)
            if stages.any_structured:  # 1. grammar bitmasks: host threads start filling them (the sampler joins)
                self.grammar.fill_bitmask(batch, logits_row_starts(batch))
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # 1b. [L, vocab] model dtype
            keep = self.drafts.has_probs and stages.any_random and batch.num_logits > batch.num_rows
            sampled = self.sampler(
                logits,
                batch.expanded_idx_mapping,
                batch.sample_positions,
                stages,  # 2.
                keep_processed=keep,
            )
        tokens, num_accepted = self.drafts.verify(batch, sampled)  # 3. [R, K+1], [R]
        tokens, num_accepted = self.parallel.broadcast_sampled(tokens, num_accepted)  # 3b. every rank: the driver's
        rs = self.request_state
        num_sampled, num_rejected = compute_num_sampled(
            batch.idx_mapping, batch.seq_lens, rs.prefill_len, num_accepted, batch.num_draft
        )
        prompt_logprobs = None
        if self.parallel.is_last_stage and self.sampling_states.prompt_logprobs.any_in(batch.idx_mapping_host):
            # 4. in chunks of 1024 positions
            prompt_logprobs = self.sampling_states.prompt_logprobs.compute(batch, hidden, self.model.compute_logits)
        output = (
            self.outputs.start(batch, tokens, num_sampled, sampled, prompt_logprobs, pooled)
            if self.parallel.is_driver
            else AsyncOutput.empty()
        )  # 5. D2H, side stream; the driver reports
        post_update(  # 6. advance the slots on the device
            batch.idx_mapping,
            batch.query_lens,
            tokens,
            num_sampled,
            num_rejected,
            rs.all_token_ids,
            rs.total_len,
            rs.num_computed,
            rs.last_sampled,
        )
        self.sampling_states.record_sampled(batch.idx_mapping, tokens, num_sampled)  # 7. penalty counts advance
        self.model_state.postprocess(batch, num_sampled, num_rejected)  # 8. architecture state advances
        spec = self.speculator
        if spec is not None and (num_propose > 0 or spec.runs_every_step):  # 9. next drafts (+ draft KV)
            proposal = spec.propose(
                ProposeInputs(
                    batch,
                    hidden,
                    aux_hidden,
                    tokens,
                    num_sampled,
                    num_rejected,
                    rs,
                    num_propose,
                    attn_metadata,
                    self._kv_capacity(batch) if attn_metadata is not None else None,
                )
            )
            rows = batch.idx_mapping.long()
            rs.draft_tokens[rows, :num_propose] = proposal.draft_token_ids.to(rs.draft_tokens.dtype)
            if proposal.draft_probs is not None:
                self.drafts.store_probs(rows, proposal.draft_probs)
            self.grammar.drafts_proposed(batch, num_propose)  # 9b. the next step's masks walk them
        return self._step_done(output)

    def _step_done(self, output: AsyncOutput) -> AsyncOutput:
        """The step's output copy has started: the grammar hand-off keeps it, the step's device-time event ends."""
        self.grammar.output_started(self.outputs.num_outputs - 1, output)
        if self.step_events is not None and self.device.type == "cuda":
            self.step_events[-1][1].record()
        return output

    def kv_connector_output(self) -> KVConnectorOutput:
        return self.kv_connector.get_finished()

    def kv_tier_stats(self) -> KVTierStats:
        return self.kv_connector.stats()

    def _kv_capacity(self, batch: InputBatch) -> torch.Tensor:
        """[R] int32: KV positions the blocks of each row hold now (host counts, copied without a sync)."""
        capacity = self.block_tables.num_blocks[batch.idx_mapping_host] * self.block_tables.block_size
        return torch.from_numpy(capacity.astype(np.int32)).to(self.device, non_blocking=True)
