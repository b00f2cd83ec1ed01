"""The V2 runner's CUDA graphs: their capture and release, and which graph (if any) a step replays.

Two kinds, sharing one capturer (one memory pool, as their replays never overlap):

- `cuda_graphs` ([`DecodeCudaGraphs`][framework.runner.graphs.cuda_graphs.DecodeCudaGraphs], `runner.cuda_graphs`): the
  forward of a pure-decode batch, per (padded batch size, tokens per row); input preparation and sampling run
  eagerly around the replay.
- `step_graphs` ([`FullStepGraphs`][framework.runner.graphs.step_graphs.FullStepGraphs],
`runner.full_step_cuda_graphs`):
  the whole graph-safe pure-decode step, inputs to post-update, as one replay.

And, in a memory pool of their own, `prefill_graphs`
([`PrefillPieceGraphs`][framework.runner.graphs.prefill_graphs.PrefillPieceGraphs],
`runner.prefill_cuda_graphs`): the forward of a step with prompt tokens as pieces between eager attentions.

`ModelRunnerV2` holds one `RunnerGraphs` as `runner.graphs` (read `runner.graphs.cuda_graphs`,
`runner.graphs.step_graphs`). Which steps replayed and why the others did not go to the runner's observer
([`StepObserver`][framework.runner.observer.StepObserver]): `on_full_step_replay`, `on_full_step_fallback(reason)`,
`on_prefill_pieces`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch

from framework.batch.block_tables import BlockTables
from framework.batch.input_batch import InputBatch, advance_num_computed_host
from framework.batch.request_state import RequestState
from framework.config.schema import Mrv2Config
from framework.kv_transfer.interface import KVConnector
from framework.layers.attention import AttentionMetadata
from framework.layers.parallel.context import ParallelContext
from framework.models.loaded import LoadedModel
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.graphs.cuda_graphs import CudaGraphCapturer, DecodeCudaGraphs, GraphCapturer, capture_sizes
from framework.runner.graphs.prefill_graphs import PrefillPieceGraphs, prefill_graph_sizes, unsupported_reason
from framework.runner.graphs.step_graphs import FullStepGraphs, FullStepResult, RowNeeds
from framework.runner.observer import StepObserver
from framework.runner.plugins import ModelState, Speculator
from framework.runner.pooling import PoolingState
from samplers.sampler import Sampler
from samplers.states import SamplingStates

# (input_ids [T], positions [T], kv_caches, metadata, **extra inputs) -> (hidden [T, hidden], aux hidden states)
ForwardWithAux = Callable[..., tuple[torch.Tensor, tuple[torch.Tensor, ...]]]


class GraphedRunner(Protocol):
    """What `RunnerGraphs` reads of its runner. Read at each call, not kept: a test may swap an owner (the
    model state, the sampler) on a built runner before it captures."""

    config: Mrv2Config
    loaded: LoadedModel
    device: torch.device
    parallel: ParallelContext
    model: Any  # the target nn.Module: (ids, positions, kv_caches, metadata) -> hidden; `compute_logits`
    model_state: ModelState
    speculator: Optional[Speculator]
    request_state: RequestState
    block_tables: BlockTables
    sampling_states: SamplingStates
    sampler: Sampler
    pooling_state: PoolingState
    kv_caches: list[torch.Tensor]
    kv_connector: KVConnector
    observer: StepObserver


class RunnerGraphs:
    """The runner's decode graphs, full-step graphs and prefill pieces (None until captured, or when not
    captured), and per step which of them replays; the runner's observer hears of each decision."""

    def __init__(self, runner: GraphedRunner) -> None:
        self.runner = runner
        self.cuda_graphs: Optional[DecodeCudaGraphs] = None
        self.step_graphs: Optional[FullStepGraphs] = None
        self.prefill_graphs: Optional[PrefillPieceGraphs] = None

    # ---- capture / release ----------------------------------------------------------------------------
    def capture(self, forward: ForwardWithAux, capturer: Optional[GraphCapturer] = None) -> Optional[str]:
        """Capture the decode graphs of `forward` (GPU with Triton attention), then the full-step graphs when
        they are on and supported; call after the KV cache exists. `capturer` replaces CUDA graph capture (CPU
        tests replay by running the captured step again). Returns why a configured kind was not captured (for
        the runner's log), or None."""
        r = self.runner
        rc = r.config.runner
        if (r.device.type != "cuda" and capturer is None) or not rc.cuda_graphs or r.parallel.pp_size > 1:
            return None  # pipeline stages pass hidden states between ranks outside the forward: they run eagerly
        state = r.model_state
        reason = state.cuda_graph_unsupported_reason() or r.model.cuda_graph_unsupported_reason()
        if reason is not None:
            return f"decode runs without CUDA graphs: {reason}"
        sizes = capture_sizes(rc.cuda_graph_sizes, r.config.scheduler.max_num_seqs)
        # One capturer (one memory pool) for the forward graphs and the full-step graphs: replays never overlap.
        shared = capturer if capturer is not None else CudaGraphCapturer()
        # A state without graph inputs reads no slot in the forward: the graphs need no idx_mapping then.
        with_inputs = type(state).prepare_graph_inputs is not ModelState.prepare_graph_inputs
        block_size, max_model_len = r.config.cache.block_size, r.loaded.max_model_len
        self.cuda_graphs = DecodeCudaGraphs(
            forward,
            r.kv_caches,
            sizes,
            r.block_tables.max_blocks_per_req,
            block_size,
            max_model_len,
            r.device,
            tokens_per_row=self._graph_tokens_per_row(),
            graph_inputs=state.prepare_graph_inputs if with_inputs else None,
            dummy_slot=state.graph_dummy_slot,
            capturer=shared,
        )
        self.cuda_graphs.capture()
        if r.speculator is not None and capturer is None:  # a draft model's own graphs (EAGLE / MTP draft steps)
            r.speculator.capture_cuda_graphs(sizes, block_size, r.block_tables.max_blocks_per_req)
        not_captured = self._capture_prefill(capturer)
        reason = self._full_step_unsupported_reason()
        if reason is not None:
            if rc.full_step_cuda_graphs:
                not_captured = "; ".join(filter(None, [not_captured, f"no full-step CUDA graphs: {reason}"]))
            return not_captured
        self.step_graphs = FullStepGraphs(
            lambda ids, pos, kv, meta: r.model(ids, pos, kv, meta),
            r.model.compute_logits,
            r.sampler,
            r.request_state,
            r.block_tables,
            r.kv_caches,
            sizes,
            max_model_len,
            r.device,
            capturer=shared,
            max_logprobs=r.config.sampler.max_logprobs,
        )
        self.step_graphs.capture()
        return not_captured

    def _capture_prefill(self, capturer: Optional[GraphCapturer]) -> Optional[str]:
        """Capture the prefill pieces when `runner.prefill_cuda_graphs` is on and the run allows them; returns
        why not when it is on and they do not."""
        r = self.runner
        if not r.config.runner.prefill_cuda_graphs:
            return None
        reason = unsupported_reason(r.model)
        if r.speculator is not None and (r.speculator.num_kv_layers or r.speculator.aux_hidden_layer_ids):
            reason = "a draft model (it reads the target's hidden states; model-free ngram drafts are served)"
        elif type(r.model_state).prepare_inputs is not ModelState.prepare_inputs:
            reason = f"{type(r.model_state).__name__} passes extra forward inputs"
        if reason is not None:
            return f"no prefill graph pieces: {reason}"
        sizes = prefill_graph_sizes(r.config.runner.prefill_cuda_graph_sizes, r.config.scheduler.max_num_batched_tokens)
        # A pool of their own: their buffers are as large as a whole prompt step, the decode graphs' are not.
        graphs = PrefillPieceGraphs(r.model, r.kv_caches, sizes, r.device, capturer)
        try:
            graphs.capture()
        except torch.OutOfMemoryError:  # what the KV cache left is too little: prompt steps stay eager
            del graphs
            if r.device.type == "cuda":
                torch.cuda.empty_cache()
            return (
                f"no prefill graph pieces: out of device memory capturing them at up to {sizes[-1]} tokens "
                "(lower runner.prefill_cuda_graph_sizes, scheduler.max_num_batched_tokens or "
                "cache.gpu_memory_utilization)"
            )
        self.prefill_graphs = graphs
        return None

    def release(self) -> None:
        """Drop every kind (the full-step graphs hold the KV caches and their own captures)."""
        self.cuda_graphs = None
        self.step_graphs = None
        self.prefill_graphs = None

    def _full_step_unsupported_reason(self) -> Optional[str]:
        """None when pure-decode steps may run as full-step graphs (`step_graphs`); otherwise why not."""
        r = self.runner
        if not r.config.runner.full_step_cuda_graphs:
            return "runner.full_step_cuda_graphs is off"
        if r.speculator is not None:
            return "speculative decoding (verification steps keep their forward graphs)"
        if r.parallel.tp_size > 1 or r.parallel.pp_size > 1:
            return "tensor / pipeline parallelism"
        return r.model_state.full_step_unsupported_reason()

    def _graph_tokens_per_row(self) -> tuple[int, ...]:
        """1 + every k the scheduler may ask to verify: all of 0..K with dynamic-k, else 0 and K."""
        spec = self.runner.config.speculator
        k_max = spec.num_speculative_tokens
        ks = range(k_max + 1) if spec.dynamic_k else {0, k_max}
        return tuple(sorted(1 + k for k in ks))

    # ---- per step --------------------------------------------------------------------------------------
    def replay_full_step(
        self, output: SchedulerOutput, slots: np.ndarray, copy_stream: Optional[torch.cuda.Stream]
    ) -> Optional[FullStepResult]:
        """A graph-safe pure-decode step (`slots` [R] its req_slots) runs whole as one replay
        (framework.runner.graphs.step_graphs); else None and the observer hears the reason."""
        graphs = self.step_graphs
        if graphs is None:
            return None
        r = self.runner
        s = r.sampling_states
        needs = functools.cache(
            lambda: RowNeeds(  # asked only for a pure-decode step that fits
                s.stages_for(slots), s.prompt_logprobs.any_in(slots), r.pooling_state.any_in(slots)
            )
        )
        reason = graphs.blocker(output, needs)
        if reason is not None:
            r.observer.on_full_step_fallback(reason)
            return None
        stages = needs().stages
        advance_num_computed_host(output, r.request_state, slots, np.ones(len(slots), np.int64))
        r.observer.on_full_step_replay()
        r.kv_connector.wait_for_loads()  # every layer at once (a one-token prompt step may load its prefix)
        return graphs.run(output, slots, stages, copy_stream)

    def replay_forward(
        self, batch: InputBatch, attn_metadata: AttentionMetadata
    ) -> Optional[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """(hidden [T, hidden], aux hidden states) from a decode-graph replay when `batch` is pure decode and a
        captured size fits (the ModelState's `prepare_graph_step` runs first); None: the forward runs eagerly."""
        graphs = self.cuda_graphs
        # Pure decode: every token gets a logits row (1 + drafts per row), and every row has as many tokens.
        pure_decode = batch.num_tokens == batch.num_logits == batch.num_rows * batch.max_query_len
        size = graphs.padded_size(batch.num_rows, batch.max_query_len) if graphs is not None and pure_decode else None
        if size is None:
            return None
        self.runner.model_state.prepare_graph_step(batch, size)
        self.runner.kv_connector.wait_for_loads()  # every layer at once (a one-token prompt step may load its prefix)
        return graphs.run(
            size,
            batch.input_ids,
            batch.positions,
            attn_metadata,  # type: ignore[union-attr]
            idx_mapping=batch.idx_mapping,
        )

    def replay_prefill(self, batch: InputBatch, attn_metadata: AttentionMetadata) -> Optional[torch.Tensor]:
        """hidden [T, hidden] from the prefill pieces when they are captured and a size holds the step's tokens;
        None: the forward runs eagerly. (Called for steps the decode graphs did not take.)"""
        graphs = self.prefill_graphs
        size = graphs.padded_size(batch.num_tokens) if graphs is not None else None
        if size is None:
            return None
        hidden = graphs.run(size, batch.input_ids, batch.positions, attn_metadata)  # type: ignore[union-attr]
        self.runner.observer.on_prefill_pieces()
        return hidden
