"""EngineCore: one step is schedule -> execute_model -> sample_tokens -> update from output."""

from __future__ import annotations

import logging
import random
from typing import Optional

from framework.compat import select_runner
from framework.config import Mrv2Config
from framework.engine_setup import load_model, num_kv_blocks, resolve_device
from framework.kv_cache_manager import KVCacheManager
from framework.model_runner import ModelRunnerV2
from framework.request import Request, RequestOutput, RequestStatus
from framework.runner_interface import ModelRunner
from framework.sampling_params import InvalidRequestError, SamplingParams
from framework.scheduler import Scheduler
from framework.v1 import ModelRunnerV1

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler, the KV block pool and the runner; validates requests on the way in."""

    def __init__(self, config: Mrv2Config) -> None:
        self.config = config
        runner_kind = select_runner(config)
        self.loaded = load_model(config, resolve_device(config.device))
        self.max_model_len = self.loaded.max_model_len
        runner_cls = ModelRunnerV1 if runner_kind == "v1" else ModelRunnerV2
        self.runner: ModelRunner = runner_cls(config, self.loaded)
        on_gpu = self.loaded.device.type == "cuda"
        peak = self.runner.profile_run() if on_gpu and config.cache.num_blocks is None else 0
        blocks = num_kv_blocks(config, self.loaded, peak)
        self.runner.initialize_kv_cache(blocks)
        self.runner.capture_cuda_graphs()
        self.kv_cache = KVCacheManager(blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, self.max_model_len)
        self._seed_rng = random.Random(config.seed)
        self._in_flight: Optional[tuple] = None  # (SchedulerOutput, AsyncOutput) of the step not yet read back
        self._arrivals = 0
        logger.info("mrv2: runner %s on %s, %d KV blocks of %d tokens", runner_kind, self.loaded.device, blocks,
                    config.cache.block_size)

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.loaded.tokenizer

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: Optional[str] = None
    ) -> None:
        """Queue a request; raises `InvalidRequestError` (and changes nothing) if it cannot be served."""
        self._validate(request_id, prompt_token_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.randrange(1 << 63)
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling_params=params,
                eos_token_id=self.loaded.eos_token_id,
                sampling_seed=seed,
                prompt=prompt,
                arrival_index=self._arrivals,
            )
        )
        self._arrivals += 1

    def _validate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request id '{request_id}' is already in use")
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidRequestError(f"request '{request_id}': the prompt is empty")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"request '{request_id}': the prompt has {n} tokens but max_model_len is {self.max_model_len} "
                "(prompt plus at least one output token must fit)"
            )
        vocab = self.loaded.vocab_size
        bad = next((t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:
            raise InvalidRequestError(f"request '{request_id}': token id {bad!r} is outside the vocabulary [0, {vocab})")
        if params.logprobs is not None and params.logprobs > self.config.sampler.max_logprobs:
            raise InvalidRequestError(
                f"request '{request_id}': logprobs={params.logprobs} exceeds sampler.max_logprobs="
                f"{self.config.sampler.max_logprobs}"
            )

    def abort_request(self, request_id: str) -> Optional[RequestOutput]:
        """Abort a request; its output (finish_reason "abort"), or None if the id is not in flight."""
        request = self.scheduler.abort_request(request_id)
        return None if request is None else self._output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or self._in_flight is not None

    def step(self) -> list[RequestOutput]:
        """Run one step; returns the requests that finished (with async scheduling: in the previous step).

        With `scheduler.async_scheduling`, step N+1 is scheduled and queued on the device before the host
        waits for step N's tokens, so the device never idles while the host does its bookkeeping.
        """
        scheduler_output = self.scheduler.schedule()  # 1. what runs this step
        future = None
        if not scheduler_output.is_empty or scheduler_output.finished_request_ids:
            self.runner.execute_model(scheduler_output)  # 2. state updates, inputs, forward (queued)
            future = self.runner.sample_tokens()  # 3. sampling and post-update (queued)
        if scheduler_output.is_empty and self._in_flight is None and self.scheduler.num_unfinished:
            raise RuntimeError("the scheduler could not schedule any waiting request (KV cache too small?)")
        current = (scheduler_output, future) if future is not None and not scheduler_output.is_empty else None
        if self.config.scheduler.async_scheduling:
            done, self._in_flight = self._in_flight, current
        else:
            done = current
        finished = []
        if done is not None:
            runner_output = done[1].get()  # 4. the only place the host waits for the device
            finished = self.scheduler.update_from_output(done[0], runner_output.sampled_token_ids)
        return [self._output(r) for r in finished]

    def _output(self, request: Request) -> RequestOutput:
        tokenizer = self.loaded.tokenizer
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=tokenizer.decode(request.output_token_ids) if tokenizer is not None else "",
            finished=request.status.is_finished,
            finish_reason=request.status.value if request.status.is_finished else None,
            stop_reason=request.stop_token_id,
            num_preemptions=request.num_preemptions,
        )

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    def is_idle(self) -> bool:
        """No request holds a slot or a block (used by leak checks)."""
        return (not self.scheduler.requests and self.kv_cache.num_free_blocks == self.kv_cache.num_blocks
                and all(r.status != RequestStatus.RUNNING for r in self.scheduler.running))
