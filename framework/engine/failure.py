"""The engine's failure policy: what a step that raised does to the requests, and when the engine gives up.

`EngineCore` holds one `StepFailurePolicy` and calls it at three points of a step: `raise_if_dead` before doing
anything, `fail_step` when the runner raised, `checked` on the outputs it returns.
"""

from __future__ import annotations

import logging
from typing import Optional

from framework.engine.output_processor import OutputProcessor
from framework.engine.parallel_sampling import ParallelSamplingTable
from framework.engine.request import RequestOutput, RequestStatus
from framework.engine.scheduler.kv_cache_manager import KVCacheManager
from framework.engine.scheduler.scheduler import Scheduler
from framework.params.request_errors import RequestStepError
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.async_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

# A runner failing this many steps in a row is not transient: the engine stops (`EngineDeadError`).
MAX_CONSECUTIVE_STEP_FAILURES = 3


class EngineDeadError(RuntimeError):
    """The engine stopped after repeated runner failures; every later call raises this. Build a new engine."""


class StepFailurePolicy:
    """Ends the running requests of a failed step with an error and, after `MAX_CONSECUTIVE_STEP_FAILURES`
    failing steps in a row (or a shutdown), marks the engine dead. With `check_invariants` it also checks the
    scheduler's invariants after every step that returns."""

    def __init__(
        self,
        scheduler: Scheduler,
        kv_cache: KVCacheManager,
        output_processor: OutputProcessor,
        parallel_sampling: ParallelSamplingTable,
        check_invariants: bool,
    ) -> None:
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.output_processor = output_processor
        self.parallel_sampling = parallel_sampling
        self.check_invariants = check_invariants
        self.consecutive_failures = 0
        self.dead: Optional[str] = None  # why the engine stopped, once it has

    def raise_if_dead(self) -> None:
        """`EngineDeadError` once the engine has stopped."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)

    def shut_down(self) -> None:
        """The engine was shut down: later calls raise (a failure's reason, if one came first, is kept)."""
        if self.dead is None:
            self.dead = "the engine was shut down (LLM.shutdown); build a new one"

    def step_succeeded(self) -> None:
        """A step's output came back: the failures so far were transient."""
        self.consecutive_failures = 0

    def checked(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs`, after the scheduler's invariants check (`scheduler.check_invariants`)."""
        if self.check_invariants:  # off by default: the step path pays one attribute test
            self.scheduler.check_invariants()
        return outputs

    def fail_step(self, err: Exception, failed: SchedulerOutput) -> list[RequestOutput]:
        """The runner raised on the step `failed`: end the running requests (all requests, once the engine gives
        up) with an error; returns their outputs. The caller drops the step it had in flight.

        A `RequestStepError` names the one request whose values raised: that request alone ends, and the other
        running requests are preempted (recomputed from their tokens so far: the step's work is lost, not them).
        """
        # The runner may have raised before freeing the slots this step released: it frees them next step.
        self.scheduler.release_again(failed.finished_request_ids)
        if isinstance(err, RequestStepError) and err.request_id in self.scheduler.requests:
            return self._fail_one_request(err)
        self.consecutive_failures += 1
        message = f"the engine step failed: {type(err).__name__}: {err}"
        logger.error("mrv2: %s", message, exc_info=err)
        victims = list(self.scheduler.running)
        if self.consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            self.dead = (
                f"the engine stopped after {self.consecutive_failures} failing steps in a row; "
                f"last: {type(err).__name__}: {err}"
            )
            victims += list(self.scheduler.waiting)
        for request in victims:
            request.error = message
            self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        # Blocks published for the failed step may never have been computed: no later request may hit them.
        self.kv_cache.reset_prefix_cache()
        ids = [r.request_id for r in victims]
        outputs = self.parallel_sampling.relabel(
            self.output_processor.process(ModelRunnerOutput(ids, [[] for _ in ids]))
        )
        return outputs if self.dead else self.checked(outputs)

    def _fail_one_request(self, err: RequestStepError) -> list[RequestOutput]:
        logger.warning("mrv2: %s (that request ends; the others of the step are recomputed)", err)
        culprit = self.scheduler.requests[err.request_id]
        culprit.error = str(err)
        self.scheduler.finish_request(err.request_id, RequestStatus.FINISHED_ERROR)
        for request in list(self.scheduler.running):
            self.scheduler.preempt(request)
        # Blocks published for the failed step may never have been computed: no later request may hit them.
        self.kv_cache.reset_prefix_cache()
        outputs = self.output_processor.process(ModelRunnerOutput([err.request_id], [[]]))
        return self.checked(self.parallel_sampling.relabel(outputs))
