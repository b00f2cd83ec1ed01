"""The interface every model runner implements (V2 now; the V1 fallback later)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Optional

import torch

from framework.params.kv_groups import KVGroupLayout
from framework.params.kv_transfer import EMPTY_KV_CONNECTOR_OUTPUT, KVConnectorOutput, KVTierStats
from framework.params.prefix_cache import PrefixCacheHooks
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import NewRequestData, SchedulerOutput
from framework.runner.async_output import AsyncOutput
from framework.runner.observer import NO_OBSERVER, StepObserver

if TYPE_CHECKING:
    from framework.config.schema import Mrv2Config
    from framework.models.loaded import LoadedModel
    from framework.runner.plugins import ModelState


class ModelRunner(ABC):
    """Turns a `SchedulerOutput` into one forward pass and its sampled tokens.

    The step is split in two so that pipeline-parallel ranks and async scheduling can interleave:
    `execute_model` updates per-request state, prepares inputs and runs the forward; `sample_tokens` samples,
    starts the copy of the results to the host and advances state. `AsyncOutput.get()` waits for the copy.
    """

    name: str
    config: "Mrv2Config"
    loaded: "LoadedModel"
    device: torch.device
    kv_caches: list[torch.Tensor]
    observer: StepObserver = NO_OBSERVER  # a benchmark's hooks (`set_observer`); no-ops by default
    num_draft_kv_layers: int = 0  # paged KV layers a speculator's draft model adds to the target's
    kv_groups: Optional[KVGroupLayout] = None  # one KV group per window size (`cache.kv_groups`); None: one table
    # What the model state keeps for cached blocks (state snapshots), for the engine's KV cache manager. Set by
    # the runner (no class default, so a parallel driver's lookup reaches its local runner's).
    prefix_cache_hooks: PrefixCacheHooks

    def set_observer(self, observer: StepObserver) -> None:
        """Call `observer`'s runner hooks from the next step on (`NO_OBSERVER` stops)."""
        self.observer = observer

    def _prefix_cache_hooks_of(self, model_state: "ModelState") -> PrefixCacheHooks:
        """Let the model state allocate what it keeps for cached blocks, before the KV cache is sized, when
        prefix caching will be on (`cache.enable_prefix_caching` not false and the state supports it; the engine
        resolves the same setting and reports a conflict)."""
        wanted = self.config.cache.enable_prefix_caching
        if wanted is False or not type(model_state).supports_prefix_caching:
            return PrefixCacheHooks()
        return model_state.init_prefix_cache(self.config.cache)

    def kv_connector_output(self) -> KVConnectorOutput:
        """The KV connector's report on the step just started: finished transfers, failed loads (none here)."""
        return EMPTY_KV_CONNECTOR_OUTPUT

    def kv_tier_stats(self) -> KVTierStats:
        """The worker side of the KV connector's counters (bytes moved, load time; zeros here)."""
        return KVTierStats()

    def profile_run(self) -> int:
        """Run one full-budget step (prefill + sampling) on dummy requests; returns peak activation bytes.

        The KV cache is sized from what is left after this peak; the step uses a throwaway cache just large
        enough, and the dummy requests leave their slots before this returns. 0 on the CPU.
        """
        cfg = self.config
        num_tokens = min(
            cfg.scheduler.max_num_batched_tokens, cfg.scheduler.max_num_seqs * (self.loaded.max_model_len - 1)
        )
        num_reqs = min(cfg.scheduler.max_num_seqs, num_tokens)
        lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        bs = cfg.cache.block_size
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50)
        per_block = 1 if self.kv_groups is None else self.kv_groups.num_groups  # one block id per group per block
        blocks, new = 0, []
        for i, n in enumerate(lens):
            need = -(-n // bs) * per_block
            new.append(NewRequestData(f"__profile_{i}", [0] * n, n, params, i, list(range(blocks, blocks + need)), 0))
            blocks += need
        self.initialize_kv_cache(blocks)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        ids = [r.request_id for r in new]
        self.execute_model(SchedulerOutput(ids, lens, [0] * num_reqs, new, []))
        self.sample_tokens().get()
        self.execute_model(SchedulerOutput([], [], [], [], [], finished_request_ids=set(ids)))  # free the slots
        self.sample_tokens().get()
        self.kv_caches = []
        if not on_gpu:
            return 0
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - base

    def determine_num_kv_blocks(self) -> int:
        """KV blocks to allocate: profiled and sized from free memory on a GPU (`engine_setup.num_kv_blocks`).

        Under parallelism every rank sizes its own device and all take the smallest count; the driver checks
        that it holds one request of max_model_len.
        """
        from framework.models.setup import check_kv_blocks, kv_blocks_that_fit

        cfg = self.config
        peak = self.profile_run() if self.device.type == "cuda" and cfg.cache.num_blocks is None else 0
        parallel = self.loaded.parallel
        blocks = parallel.min_over_ranks(kv_blocks_that_fit(cfg, self.loaded, peak, self.num_draft_kv_layers))
        if parallel.is_driver:
            check_kv_blocks(cfg, self.loaded, blocks)
        return blocks

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the paged KV cache."""

    def capture_cuda_graphs(self) -> None:
        """Capture CUDA graphs once the KV cache exists (runners without graphs do nothing)."""

    def release_cuda_graphs(self) -> None:
        """Drop the CUDA graphs (runners override this to drop theirs, then call it) and wait for the device: under
        tensor parallelism they hold captured NCCL collectives, and a communicator is only torn down once no graph
        refers to it."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        """Free the device memory this runner holds beyond the weights (graphs, KV caches); unusable after."""
        self.release_cuda_graphs()
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @abstractmethod
    def execute_model(self, output: SchedulerOutput) -> None: ...

    @abstractmethod
    def sample_tokens(self) -> AsyncOutput: ...
