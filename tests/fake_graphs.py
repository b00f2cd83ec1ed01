"""A `GraphCapturer` for CPU tests: "replay" runs the captured step again on the same static buffers.

A CUDA graph replays the device work its step queued at capture, on the buffers it read then. Running the step
again is the same computation whenever the step reads only the static buffers (and persistent per-slot tensors)
and its host-side logic does not depend on a step's data: what `DecodeCudaGraphs` and
`ModelState.prepare_graph_inputs` promise. So a CPU test can drive the whole "static inputs + replay" path
(buffer filling, padding rows, the dummy slot, the state's graph inputs and graph-step hooks) and compare it
with eager execution. What it cannot see: host values frozen into a real graph at capture.
"""

from __future__ import annotations

from typing import Any, Callable


class EagerReplay:
    """One "captured" step; counts its replays."""

    def __init__(self, step: Callable[[], Any]) -> None:
        self.step = step
        self.num_replays = 0

    def replay(self) -> Any:
        self.num_replays += 1
        return self.step()


class EagerReplayCapturer:
    """Runs each step once at capture (the warm-up a CUDA capture does) and keeps it for replays."""

    def __init__(self) -> None:
        self.captured: list[EagerReplay] = []

    def capture(self, step: Callable[[], Any]) -> EagerReplay:
        step()
        self.captured.append(EagerReplay(step))
        return self.captured[-1]

    def finish(self) -> None:
        pass

    @property
    def num_replays(self) -> int:
        return sum(c.num_replays for c in self.captured)
