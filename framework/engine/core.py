"""EngineCore: one step is schedule -> execute_model -> sample_tokens -> update from output.

What a failing step does is `framework.engine.failure`'s (`StepFailurePolicy`); the core starts the engine up
and runs steps.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import traceback
from typing import Optional

import torch

from framework.config.schema import ConfigError, Mrv2Config
from framework.engine.audio_inputs import WhisperPromptProcessor
from framework.engine.failure import StepFailurePolicy
from framework.engine.lora_catalog import LoraCatalog
from framework.engine.output_processor import OutputProcessor
from framework.engine.parallel_sampling import ParallelSamplingTable, fan_out
from framework.engine.request import Request, RequestOutput, RequestStatus
from framework.engine.runner_selection import select_runner
from framework.engine.scheduler.prefix import recompute_failed_loads
from framework.engine.scheduler.scheduler import Scheduler
from framework.engine.scheduler.window import build_kv_cache_manager
from framework.engine.validation import RequestValidator
from framework.kv_transfer.build import build_kv_connector, check_kv_connector, snapshot_bytes
from framework.kv_transfer.interface import KVConnectorContext, NoKVConnector
from framework.models.interface import EncoderDecoder
from framework.models.setup import kv_bytes_per_block, load_model, resolve_device
from framework.params.encoder_input import EncoderInput
from framework.params.kv_transfer import KVTierStats
from framework.params.lora_request import LoRARequest
from framework.params.pooling_params import POOLING_SAMPLING_PARAMS, PoolingParams
from framework.params.prefix_cache import PrefixCacheHooks, PrefixCacheStats
from framework.params.sampling_params import (
    SamplingParams,
)
from framework.runner.interface import ModelRunner
from framework.runner.logits_processors import logits_processor_classes
from framework.runner.model_runner import ModelRunnerV2
from framework.runner.observer import NO_OBSERVER, StepObserver
from framework.runner.plugins import SpecDecodeMetrics, build_draft_policy
from framework.runner.v1 import ModelRunnerV1
from samplers.sampler import ROW_ERROR_MESSAGES

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler, the KV block pool and the runner; validates requests on the way in."""

    def __init__(self, config: Mrv2Config) -> None:
        try:
            self._start(config)
        except BaseException as err:
            self.shutdown()  # stop the other ranks of a parallel run
            # Free what start-up allocated (weights, KV cache) now, even while the caller keeps the exception:
            # its traceback's frames would otherwise hold them.
            self.__dict__.clear()
            traceback.clear_frames(err.__traceback__)
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            raise

    def _start(self, config: Mrv2Config) -> None:
        self.config = config
        runner_kind = select_runner(config)
        self.runner: ModelRunner
        if config.parallel.world_size > 1:  # spawns (or joins under torchrun) the other ranks
            if runner_kind != "v2":
                raise ConfigError(
                    "parallel: tensor/pipeline parallelism needs the V2 runner, but the config selects V1"
                )
            from framework.executor.driver import start_parallel

            self.loaded, self.runner = start_parallel(config)
        else:
            self.loaded = load_model(config, resolve_device(config.device))
            runner_cls = ModelRunnerV1 if runner_kind == "v1" else ModelRunnerV2
            self.runner = runner_cls(config, self.loaded)
        self.max_model_len = self.loaded.max_model_len
        # Encoder-decoder (Whisper) models take audio prompts: this turns them into decoder ids + encoder input.
        self.audio: Optional[WhisperPromptProcessor] = (
            WhisperPromptProcessor(self.loaded.hf_config, config.model.path)
            if isinstance(self.loaded.model, EncoderDecoder)
            else None
        )
        prefix_caching = self._prefix_caching(config)
        hooks = getattr(self.runner, "prefix_cache_hooks", None)
        state_name = type(self.runner.model_state).name
        check_kv_connector(config, runner_kind, prefix_caching, hooks or PrefixCacheHooks(), state_name)
        blocks = self.runner.determine_num_kv_blocks()  # profiled on a GPU; the minimum over ranks
        self.runner.initialize_kv_cache(blocks)
        self.runner.capture_cuda_graphs()
        self.kv_cache = build_kv_cache_manager(config, self.runner, self.loaded.model, blocks, prefix_caching, hooks)
        block_bytes = kv_bytes_per_block(self.loaded, config.cache.block_size, self.runner.num_draft_kv_layers)
        # Another tier of KV blocks (the host-memory tier): its scheduler side, told of the cache's evictions.
        snapshots = snapshot_bytes(self.runner.model_state.snapshot_tensors())  # carried by a KV tier
        self.kv_connector = build_kv_connector(
            KVConnectorContext(
                "scheduler", config.cache, block_bytes, self.loaded.device, snapshots, self.kv_cache.hooks
            )
        )
        if not isinstance(self.kv_connector, NoKVConnector):
            self.kv_cache.add_eviction_observer(self.kv_connector.on_block_evicted)
        self.spec_metrics = SpecDecodeMetrics()
        self.draft_policy = build_draft_policy(config.speculator)
        lookahead = max(config.speculator.num_speculative_tokens - 1, 0) if self.runner.num_draft_kv_layers else 0
        self.scheduler = Scheduler(
            config.scheduler,
            self.kv_cache,
            self.max_model_len,
            self.draft_policy,
            self.spec_metrics,
            draft_kv_lookahead=lookahead,
            max_loras=config.lora.max_loras if config.lora.enable else 0,
            kv_connector=self.kv_connector,
        )
        if config.lora.enable and self.runner.name != "v2":
            raise ConfigError("lora.enable: LoRA adapters run on the V2 runner only (use runner=v2 or runner=auto)")
        self.lora_catalog = LoraCatalog(config.lora, self.loaded.model)  # adapters checked before queueing
        self.output_processor = OutputProcessor(self.loaded.tokenizer, self.scheduler)
        self.parallel_sampling = ParallelSamplingTable()  # n > 1 requests: parent id <-> child requests
        self._processor_classes = logits_processor_classes(config.sampler.logits_processors)
        self._full_sampler = self.runner.name == "v2"  # the V2 runner, local or behind a parallel driver
        if not self._full_sampler and config.sampler.logits_processors:
            raise ConfigError(
                "sampler.logits_processors: the V1 runner does not run custom logits processors; "
                "use runner=v2 or runner=auto"
            )
        self.validator = RequestValidator(
            config,
            self.loaded,
            self.audio,
            self.runner,
            self._processor_classes,
            lambda request_id: request_id in self.scheduler.requests or request_id in self.parallel_sampling,
        )
        self._seed_rng = random.Random(config.seed)
        self._in_flight: Optional[tuple] = None  # (SchedulerOutput, AsyncOutput) of the step not yet read back
        self._arrivals = 0
        self.failures = StepFailurePolicy(
            self.scheduler,
            self.kv_cache,
            self.output_processor,
            self.parallel_sampling,
            config.scheduler.check_invariants,
        )
        self.observer: StepObserver = NO_OBSERVER  # a benchmark's hooks (`set_observer`)
        kv_gib = blocks * block_bytes / 2**30
        logger.info(
            "mrv2: runner %s on %s, %d KV blocks of %d tokens (%d tokens, %s, %.2f GiB), prefix caching %s",
            runner_kind,
            self.loaded.device,
            blocks,
            config.cache.block_size,
            blocks * config.cache.block_size,
            str(self.loaded.kv_dtype).removeprefix("torch."),
            kv_gib,
            "on" if self.kv_cache.enable_prefix_caching else "off",
        )

    def _prefix_caching(self, config: Mrv2Config) -> bool:
        """`cache.enable_prefix_caching` resolved: null = on where the ModelState supports it."""
        wanted = config.cache.enable_prefix_caching
        state_cls = type(self.runner.model_state)
        if wanted is False:
            return False
        if getattr(state_cls, "supports_prefix_caching", False):
            return True
        reason = (
            f"model state '{state_cls.name}' ({state_cls.__module__}.{state_cls.__qualname__}) does not "
            "declare supports_prefix_caching"
        )
        if wanted:
            raise ConfigError(
                f"cache.enable_prefix_caching=true cannot be served: {reason} "
                "(set cache.enable_prefix_caching=false or null)"
            )
        logger.info("mrv2: prefix caching off: %s", reason)
        return False

    def shutdown(self) -> None:
        """Free the runner's KV caches and CUDA graphs and stop the other ranks of a parallel run; the engine is
        unusable after (the weights stay loaded)."""
        failures = self.__dict__.get("failures")  # absent when start-up failed before it was built
        if failures is not None:
            failures.shut_down()
        shutdown = getattr(self.__dict__.get("runner"), "shutdown", None)
        if shutdown is not None:
            shutdown()

    def set_observer(self, observer: Optional[StepObserver]) -> None:
        """Call `observer`'s hooks from the next step on: the engine's `on_step`, the runner's graph hooks. None
        detaches it (the no-op `NO_OBSERVER` again)."""
        self.observer = observer if observer is not None else NO_OBSERVER
        self.runner.set_observer(self.observer)

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.loaded.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Optional[SamplingParams],
        prompt: Optional[str] = None,
        pooling_params: Optional[PoolingParams] = None,
        encoder_input: Optional[EncoderInput] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        """Queue a request; raises `InvalidRequestError` (and changes nothing) if it cannot be served.
        With `lora_request` it runs with that LoRA adapter (`lora.enable`), checked here before it is queued.

        The request keeps its own copy of `params`, with string `bad_words` tokenised. With `pooling_params`
        it is an embedding request: its prompt is computed and pooled, nothing is sampled (`params` is ignored).
        An encoder-decoder (Whisper) model needs `encoder_input` (see `WhisperPromptProcessor.process`), and
        `prompt_token_ids` is then the decoder prompt; other models refuse it.
        """
        self.failures.raise_if_dead()
        if pooling_params is not None:
            pooling_params = self.validate_pooling(request_id, pooling_params)
            params = POOLING_SAMPLING_PARAMS
        assert params is not None, "a generation request needs SamplingParams"
        params = self._validate(request_id, prompt_token_ids, params, encoder_input, pooling_params is not None)
        self.lora_catalog.check(request_id, lora_request)
        extra_eos = [t for t in self.loaded.extra_eos_token_ids if t not in params.stop_token_ids]
        if extra_eos and not params.ignore_eos:  # the checkpoint's other eos ids end it too (vLLM does the same)
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *extra_eos])
        children = fan_out(request_id, params)  # n > 1: one child request per sequence
        for child_id, child_params in children:
            seed = child_params.seed if child_params.seed is not None else self._seed_rng.randrange(1 << 63)
            request = Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=child_params,
                eos_token_id=self.loaded.eos_token_id,
                sampling_seed=seed,
                prompt=prompt,
                arrival_index=self._arrivals,
                pooling_params=pooling_params,
                encoder_input=encoder_input,
                lora=lora_request,
                cache_extra_keys=(lora_request.cache_key,) if lora_request is not None else (),
            )
            self.scheduler.add_request(request)
            self.output_processor.add_request(request)
            self._arrivals += 1
        self.parallel_sampling.add(request_id, [child_id for child_id, _ in children])

    def _validate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        encoder_input: Optional[EncoderInput] = None,
        pooling: bool = False,
    ) -> SamplingParams:
        """`RequestValidator.validate`: the prepared params, or `InvalidRequestError`."""
        return self.validator.validate(request_id, prompt_token_ids, params, encoder_input, pooling)

    def _check_encoder_input(self, request_id: str, encoder_input: Optional[EncoderInput]) -> None:
        self.validator.check_encoder_input(request_id, encoder_input)

    def validate_pooling(self, request_id: str, params: PoolingParams) -> PoolingParams:
        return self.validator.validate_pooling(request_id, params)

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a request (every sequence of an n > 1 request); its output (finish_reason "abort"; for n > 1 the
        first sequence still in flight), or None if the id is not in flight.

        Aborting an unknown or already finished id is not an error: it returns None and changes nothing.
        """
        outputs = []
        for child_id in self.parallel_sampling.children(request_id):
            request = self.scheduler.abort_request(child_id)
            if request is not None:
                outputs.append(self.output_processor.abort(request))
        return self.parallel_sampling.relabel(outputs)[0] if outputs else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (with async scheduling: in the previous step),
        plus the progress of streaming requests (`SamplingParams.output_kind` "delta" or "cumulative").

        With `scheduler.async_scheduling`, step N+1 is scheduled and queued on the device before the host
        waits for step N's tokens, so the device never idles while the host does its bookkeeping.

        An exception from the runner ends every running request with finish_reason "error" (the message names
        the exception), frees their blocks and slots, and the engine serves the waiting requests next step.
        After `MAX_CONSECUTIVE_STEP_FAILURES` failing steps in a row it ends every request that way and is
        dead: later calls raise `EngineDeadError`.
        """
        self.failures.raise_if_dead()
        scheduler_output = self.scheduler.schedule()  # 1. what runs this step
        future = None
        if not scheduler_output.is_empty or scheduler_output.finished_request_ids:
            try:
                self.runner.execute_model(scheduler_output)  # 2. state updates, inputs, forward (queued)
                self._kv_connector_report()  # 2b. failed loads of another KV tier: their requests recompute
                self.observer.on_step(scheduler_output)  # a no-op unless a benchmark observes
                future = self.runner.sample_tokens()  # 3. sampling and post-update (queued)
            except Exception as err:
                self._in_flight = None  # its requests are running: they end with the error, their tokens dropped
                return self.failures.fail_step(err, scheduler_output)
        if scheduler_output.is_empty and self._in_flight is None and self.scheduler.num_unfinished:
            raise RuntimeError("the scheduler could not schedule any waiting request (KV cache too small?)")
        current = (scheduler_output, future) if future is not None and not scheduler_output.is_empty else None
        if self.config.scheduler.async_scheduling:
            done, self._in_flight = self._in_flight, current
        else:
            done = current
        if done is None:
            if self.draft_policy is not None:
                self.draft_policy.device_idled()  # the next interval between outputs is no step's cost
            return self.failures.checked([])
        try:
            runner_output = done[1].get()  # 4. the only place the host waits for the device
        except Exception as err:
            self._in_flight = None
            return self.failures.fail_step(err, done[0])
        if self.draft_policy is not None:
            self.draft_policy.observe_output(done[0])  # dynamic-k times the steps here
        self.failures.step_succeeded()
        codes = runner_output.errors  # per row, 0 almost always: one C-level scan instead of a message per row
        errors = [ROW_ERROR_MESSAGES.get(code) for code in codes] if codes and any(codes) else None
        finished = self.scheduler.update_from_output(done[0], runner_output.sampled_token_ids, errors)  # 5. stops
        outputs = self.output_processor.process(runner_output, finished)  # 6. logprobs, text, stop strings, deltas
        return self.failures.checked(self.parallel_sampling.relabel(outputs))  # 7. n > 1: children as sequences

    def _kv_connector_report(self) -> None:
        """Hand the KV connector's report on the step just started to its scheduler side; requests holding a
        block whose load failed are preempted and recompute (`recompute_failed_loads`)."""
        output = self.runner.kv_connector_output()
        self.kv_connector.update_from_output(output)
        if output.failed_block_ids:
            scheduler = self.scheduler
            scheduler.hold_admissions = recompute_failed_loads(
                self.kv_cache, scheduler.running, output, scheduler.preempt
            )

    @property
    def kv_tier_stats(self) -> KVTierStats:
        """The KV connector's counters since start-up (host-tier hits, failed loads, bytes each way, load time)."""
        worker = self.runner.kv_tier_stats()
        return dataclasses.replace(
            self.kv_connector.stats(),
            bytes_to_tier=worker.bytes_to_tier,
            bytes_to_device=worker.bytes_to_device,
            load_seconds=worker.load_seconds,
            num_loads=worker.num_loads,
        )

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters since start-up: tokens looked up (`queries`), served from the cache (`hits`)."""
        return dataclasses.replace(self.kv_cache.stats)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the device cache and in a KV tier (e.g. between benchmark runs); running
        requests keep their blocks."""
        self.kv_cache.reset_prefix_cache()
        self.kv_connector.reset()

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    def is_idle(self) -> bool:
        """No request holds a slot or a block (used by leak checks)."""
        return (
            not self.scheduler.requests
            and self.kv_cache.num_free_blocks == self.kv_cache.num_blocks
            and all(r.status != RequestStatus.RUNNING for r in self.scheduler.running)
        )
