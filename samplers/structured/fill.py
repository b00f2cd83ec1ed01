"""Grammar bitmask rows filled on a small pool of host threads, while the main thread queues the step.

llguidance computes one matcher's mask in native code without the GIL (`LLMatcher.unsafe_compute_mask_ptr`),
so a few threads can fill rows at once. `start` hands the rows to the workers and returns; `join` (called just
before the sampler needs the masks) lets the main thread fill whatever is left and waits for the rest.

Workers pay only for masks that are dear. Each row a worker fills costs it a GIL hand-off with a main thread
that is busy queueing the step; on the H200 host, with the nano bench's cheap masks (~6 us each), 8 workers
took 3.3 ms per 128 masks against 1.4 ms for the joining thread alone, while masks of ~0.5 ms each (a large
vocabulary with many live tokens) went 4.5x faster on 8 workers. So the filler measures the CPU time per
mask as it fills and hands a step to the workers only while that is at least `workers_from_mask_s`.

Why not llguidance's own `LLExecutor` (one call for all rows, on a rayon pool): measured on the dev CPU at the
nano geometry (128 masks per step), it took 1.0-1.1 ms per step against 0.5 ms for the same masks one matcher
at a time, and every call mapped and unmapped memory (~75 mmap/munmap pairs per call). See
docs/structured-outputs.md (Performance).
"""

from __future__ import annotations

import os
import queue
import threading
import time
import weakref
from typing import NamedTuple, Optional, Sequence

import llguidance

ROWS_PER_CHUNK = 4  # rows a thread takes at a time: few enough that the threads share the work evenly
WORKERS_FROM_MASK_S = 50e-6  # CPU seconds per mask from which workers beat the joining thread (see above)
MASK_COST_SMOOTHING = 0.25  # weight of the newest step in the running per-mask cost


class FillJob(NamedTuple):
    """One constrained batch row: its matcher writes `1 + len(drafts)` mask rows from `mask_row` on."""

    matcher: llguidance.LLMatcher
    mask_row: int  # first row of the host bitmask this job writes
    drafts: list[int]  # the drafts the grammar accepts (row j of the job = the mask after drafts 1..j)


class FillTiming(NamedTuple):
    """Host seconds of one step's fill: all of it, and the part the main thread spent in `join` (not hidden)."""

    fill_s: float  # first row taken .. last row written (on any thread)
    exposed_s: float  # join called .. returned (filling rows itself, then waiting): the fill's cost to the step


def default_fill_threads() -> int:
    """min(8, the CPUs this process may run on)."""
    return min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class _Task:
    """One step's rows, taken in chunks by the workers and then the joining thread."""

    def __init__(self, jobs: Sequence[FillJob], base_ptr: int, row_bytes: int, num_workers: int) -> None:
        self.jobs, self.base_ptr, self.row_bytes = jobs, base_ptr, row_bytes
        self.chunks = iter(range(0, len(jobs), ROWS_PER_CHUNK))  # next() on a range iterator is atomic
        self.lock = threading.Lock()
        self.running = num_workers  # workers that have not finished this task yet
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.first_take = self.last_write = 0.0
        self.cpu_s, self.num_masks = 0.0, 0  # CPU time of the threads that filled rows, and the rows' masks
        if num_workers == 0:
            self.done.set()

    def run_chunks(self) -> None:
        """Fill chunks until none is left (any thread)."""
        jobs, base, nbytes = self.jobs, self.base_ptr, self.row_bytes
        # The mask cost is this thread's CPU time over its rows: wall time would also count its waits for the
        # GIL, which grow with the very workers the cost decides on (a thread blocked on the GIL uses no CPU).
        clock, masks, cpu_start = time.perf_counter, 0, time.thread_time()
        try:
            for first in self.chunks:
                if not self.first_take:  # the first thread here (a benign race: any of them is close enough)
                    self.first_take = clock()
                for job in jobs[first : first + ROWS_PER_CHUNK]:
                    ptr = base + job.mask_row * nbytes
                    if job.drafts:
                        job.matcher.unsafe_compute_mask_ptr_with_draft_token(ptr, nbytes, job.drafts)
                    else:
                        job.matcher.unsafe_compute_mask_ptr(ptr, nbytes)
                    masks += 1 + len(job.drafts)
        except BaseException as err:  # handed to the joining thread
            self.error = err
            for _ in self.chunks:  # the others stop at their next chunk
                pass
        now, cpu = clock(), time.thread_time() - cpu_start
        with self.lock:
            self.last_write = max(self.last_write, now)
            self.cpu_s += cpu if masks else 0.0
            self.num_masks += masks

    def worker_finished(self) -> None:
        with self.lock:
            self.running -= 1
            if self.running == 0:
                self.done.set()


def _worker(tasks: "queue.SimpleQueue[Optional[_Task]]") -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        task.run_chunks()
        task.worker_finished()


class BitmaskFiller:
    """Up to `num_threads` workers (0: the rows are filled by the thread that joins). One task in flight at a time.

    A step goes to the workers only once the running CPU cost per mask (`mask_cost_s`, CPU time of whichever
    thread filled) is at least `workers_from_mask_s`; until then, and for cheap masks, the joining thread fills.
    """

    def __init__(self, num_threads: int, workers_from_mask_s: float = WORKERS_FROM_MASK_S) -> None:
        if num_threads < 0:
            raise ValueError(f"sampler.structured_outputs_fill_threads must be >= 0, got {num_threads}")
        self.num_threads = num_threads
        self.workers_from_mask_s = workers_from_mask_s
        self.mask_cost_s: Optional[float] = None  # running CPU seconds per mask; None before the first fill
        self._task: Optional[_Task] = None
        self._start_workers()

    @property
    def uses_workers(self) -> bool:
        """Whether the next step's rows go to the workers."""
        if self.num_threads == 0:
            return False
        if self.workers_from_mask_s <= 0:
            return True
        return self.mask_cost_s is not None and self.mask_cost_s >= self.workers_from_mask_s

    def _start_workers(self) -> None:
        self._pid = os.getpid()
        self._tasks: queue.SimpleQueue[Optional[_Task]] = queue.SimpleQueue()
        for i in range(self.num_threads):
            threading.Thread(target=_worker, args=(self._tasks,), daemon=True, name=f"mrv2-grammar-fill-{i}").start()
        weakref.finalize(self, _stop_workers, self._tasks, self.num_threads)  # the workers hold no reference to self

    def start(self, jobs: Sequence[FillJob], base_ptr: int, row_bytes: int) -> None:
        """Begin filling; each job writes rows `mask_row ..` of the buffer at `base_ptr` (rows of `row_bytes`).

        The matchers are the workers' until `join` returns: the caller does not advance them meanwhile."""
        self.join()  # never two in flight (a step that failed between start and join)
        if os.getpid() != self._pid:  # a forked child has none of the parent's threads
            self._start_workers()
        workers = self.num_threads if self.uses_workers else 0
        self._task = task = _Task(jobs, base_ptr, row_bytes, workers)
        for _ in range(workers):
            self._tasks.put(task)

    @property
    def in_flight(self) -> bool:
        return self._task is not None

    def join(self) -> Optional[FillTiming]:
        """Help fill what is left, wait for the workers, re-raise a worker's error; None if nothing was started."""
        task, self._task = self._task, None
        if task is None:
            return None
        joined = time.perf_counter()
        task.run_chunks()
        task.done.wait()
        if task.error is not None:
            raise task.error
        end = time.perf_counter()
        if task.num_masks:
            cost = task.cpu_s / task.num_masks
            last = self.mask_cost_s
            self.mask_cost_s = cost if last is None else last + MASK_COST_SMOOTHING * (cost - last)
        first = task.first_take or joined  # no rows at all: nothing was filled
        return FillTiming(max(task.last_write - first, 0.0), end - joined)


def _stop_workers(tasks: "queue.SimpleQueue[Optional[_Task]]", num_threads: int) -> None:
    for _ in range(num_threads):
        tasks.put(None)
