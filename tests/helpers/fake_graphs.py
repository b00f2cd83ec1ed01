"""A `GraphCapturer` for CPU tests: "replay" runs the captured step again on the same static buffers.

A CUDA graph replays the device work its step queued at capture, on the buffers it read then. Running the step
again is the same computation whenever the step reads only the static buffers (and persistent per-slot tensors)
and its host-side logic does not depend on a step's data: what `DecodeCudaGraphs` and
`ModelState.prepare_graph_inputs` promise. So a CPU test can drive the whole "static inputs + replay" path
(buffer filling, padding rows, the dummy slot, the state's graph inputs and graph-step hooks) and compare it
with eager execution. What it cannot see by itself: host values frozen into a real graph at capture, and tensors
the step reaches through attributes that were reallocated since (a real graph reads the old address).
`StaticInputsCapturer` checks both at every replay: the step may read only storages it read at capture, and no
device value on the host.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


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


class StaticInputsViolation(AssertionError):
    """A captured step read a tensor a real CUDA graph would not see (or read device data on the host)."""


# Tensor methods that hand device data to Python (under inference mode they skip the dispatcher's
# `_local_scalar_dense`, so they are caught one level up).
_HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}
# CPU references that loop over rows on the host by design; on a GPU the Triton kernel runs in their place.
_CPU_ONLY_HOST_READERS = (str(Path(__file__).resolve().parents[2] / "framework" / "layers" / "attention" / "paged.py"),)


class _HostReads(TorchFunctionMode):
    def __init__(self, log: list[str]) -> None:
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _HOST_READS:
            caller = sys._getframe(1)  # the code that asked for the value
            if caller.f_code.co_filename not in _CPU_ONLY_HOST_READERS:
                self.log.append(f"{func.__name__} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
        return func(*args, **(kwargs or {}))


class _ReadTracker(TorchDispatchMode):
    """Records the storages a step reads that it did not allocate itself ("inputs"), and host reads of data."""

    def __init__(self) -> None:
        super().__init__()
        self.inputs: set[int] = set()
        self._made: set[int] = set()
        self.host_reads: list[str] = []
        self._function_mode = _HostReads(self.host_reads)

    def __enter__(self):  # type: ignore[no-untyped-def]
        self._function_mode.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self._function_mode.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), int(t), bool(t), .tolist()
            self.host_reads.append(str(func))
        for t in _tensors((args, kwargs)):
            if t.dim() > 0:  # 0-dim tensors are the wrapped Python numbers of `x * 2.0`
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self._made:
                    self.inputs.add(ptr)
        out = func(*args, **kwargs)
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in self.inputs:
                self._made.add(ptr)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


class StaticReplay(EagerReplay):
    """Replays like `EagerReplay`, and fails when the step reads a storage it did not read at capture (a tensor
    reallocated since, or a per-step tensor: a real graph would read the captured address) or reads device data
    on the host (`.item()`, `bool(t)`: a real graph freezes the value of capture)."""

    def __init__(self, step: Callable[[], Any], captured_inputs: set[int]) -> None:
        super().__init__(step)
        self.captured_inputs = captured_inputs

    def replay(self) -> Any:
        self.num_replays += 1
        with _ReadTracker() as tracker:
            out = self.step()
        new = tracker.inputs - self.captured_inputs
        if new or tracker.host_reads:
            raise StaticInputsViolation(
                f"the replayed step read {len(new)} storage(s) it did not read at capture"
                f" and made host read(s) of device data: {tracker.host_reads[:3]}"
            )
        return out


class StaticInputsCapturer(EagerReplayCapturer):
    """`EagerReplayCapturer` whose replays check that the step reads only what it read at capture."""

    def capture(self, step: Callable[[], Any]) -> EagerReplay:
        with _ReadTracker() as tracker:
            step()
        if tracker.host_reads:
            raise StaticInputsViolation(f"the captured step made host read(s) of device data: {tracker.host_reads[:3]}")
        self.captured.append(StaticReplay(step, tracker.inputs))
        return self.captured[-1]
