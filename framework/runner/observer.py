"""What a benchmark (or a test) sees of the engine's steps: one observer object, called at named points.

The engine calls `on_step` for every step it hands to the runner; the V2 runner's graphs call the graph hooks.
Both hold `NO_OBSERVER` until someone attaches one (`EngineCore.set_observer`), so an unobserved step pays one
call of an empty method per hook. The interface lives here, in the runner's folder, because the runner is the
lowest layer that calls it; the engine above reaches it through the same import.
"""

from __future__ import annotations

from framework.params.scheduler_output import SchedulerOutput


class StepObserver:
    """Hooks called during the engine's steps; each does nothing here. Subclass and override the ones you need
    (framework/entrypoints/bench/counters.py counts them for `mrv2 bench`). Hooks must not raise: they run on the
    step path."""

    def on_step(self, output: SchedulerOutput) -> None:
        """The engine handed `output` to the runner (`execute_model` returned); empty steps that only free slots
        included."""

    def on_full_step_replay(self) -> None:
        """A pure-decode step ran whole as one full-step graph replay (`runner.full_step_cuda_graphs`)."""

    def on_full_step_fallback(self, reason: str) -> None:
        """Full-step graphs are captured, but this step could not run as one; `reason` says why (e.g. "not pure
        decode", "structured outputs")."""

    def on_prefill_pieces(self) -> None:
        """A step's forward replayed the prefill graph pieces (`runner.prefill_cuda_graphs`)."""


# The observer of an engine nobody observes: every hook is a no-op.
NO_OBSERVER = StepObserver()
