"""What `mrv2 bench` counts of a run: a `StepObserver` the bench attaches to the engine for the timed run.

`bench.json` reports `full_step_replays` and `prefill_piece_steps` from it, and `bench.step_timeline` builds its
per-step records from the steps it keeps (framework/entrypoints/bench/timeline.py), and its KV footprint from
the `KVFootprint` it samples each step (framework/entrypoints/bench/kv_footprint.py).
"""

from __future__ import annotations

from collections import Counter
from typing import Optional

from framework.entrypoints.bench.kv_footprint import KVFootprint
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.observer import StepObserver


class BenchCounters(StepObserver):
    """Counts the steps the runner's graphs replayed (and why full steps were not), and, with `keep_steps`,
    keeps every executed step's `SchedulerOutput` in order; with `kv_footprint`, samples it every step."""

    def __init__(self, keep_steps: bool = False, kv_footprint: Optional[KVFootprint] = None) -> None:
        self.steps_run = 0  # steps handed to the runner
        self.full_step_replays = 0  # steps run whole as one full-step graph replay
        self.full_step_fallbacks: Counter[str] = Counter()  # the other steps, by why they were not
        self.prefill_piece_steps = 0  # steps whose forward replayed the prefill graph pieces
        self.steps: Optional[list[SchedulerOutput]] = [] if keep_steps else None
        self.kv_footprint = kv_footprint

    def on_step(self, output: SchedulerOutput) -> None:
        self.steps_run += 1
        if self.kv_footprint is not None:
            self.kv_footprint.sample()
        if self.steps is not None:
            self.steps.append(output)

    def on_full_step_replay(self) -> None:
        self.full_step_replays += 1

    def on_full_step_fallback(self, reason: str) -> None:
        self.full_step_fallbacks[reason] += 1

    def on_prefill_pieces(self) -> None:
        self.prefill_piece_steps += 1
