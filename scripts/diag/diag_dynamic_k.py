"""Where dynamic-k loses against the best fixed k: its policy's host work, its choices of k, or neither.

For each cell (workload, batch) of `scripts/bench_spec.py` given with `--cells`, one speculating engine runs
the same requests round-robin under four policies:

* `fixed`: the cell's best fixed k (`FixedK`);
* `shadow`: a `DynamicK` that observes and decides every step as usual but whose k is thrown away: the
  step runs at the fixed k. Its cost over `fixed` is the policy's host work;
* `dynamic`: `DynamicK` itself;
* `replay`: the k sequence `dynamic` chose in its last run, replayed with no policy work. Its cost over
  `fixed` is what the choices of k cost (explorations, switches), without the host work.

Per run it reports tokens/s, the median step time of steady steps (the same k for the last 5 steps) and
the garbage collector's pauses in the run (`gc.callbacks`). Writes `diag_dynamic_k.json` into `--out` and
prints a table.

    python scripts/diag_dynamic_k.py --cells sampled:16:0 greedy-repeat:1:5 greedy-repeat:256:5 --out /tmp/dk
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
from bench_policy_host import Clock  # noqa: E402
from bench_spec import K_MAX, build_llm, pin_cpus, run_once, set_policy, warm_up, workload  # noqa: E402


class ShadowK:
    """Runs a `DynamicK` in full (choose, observe) but always returns `k`."""

    wants_step_times = True

    def __init__(self, inner: Any, k: int) -> None:
        self.inner, self.k, self.max_k = inner, k, inner.max_k

    def choose(self, request_ids: Sequence[str]) -> int:
        self.inner.choose(request_ids)
        return self.k

    def observe_acceptance(self, *args: Any) -> None:
        self.inner.observe_acceptance(*args)

    def observe_step(self, *args: Any) -> None:
        self.inner.observe_step(*args)

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)


class ReplayK:
    """Replays a recorded sequence of k (then its last k), with no policy work."""

    wants_step_times = False

    def __init__(self, max_k: int) -> None:
        self.max_k, self.ks, self.i = max_k, [0], 0

    def load(self, ks: list[int]) -> None:
        self.ks, self.i = ks or [0], 0

    def choose(self, request_ids: Sequence[str]) -> int:
        k = self.ks[min(self.i, len(self.ks) - 1)]
        self.i += 1
        return k

    def observe_acceptance(self, *args: Any) -> None:
        pass

    def observe_step(self, *args: Any) -> None:
        pass

    def remove_request(self, request_id: str) -> None:
        pass


class TimedPolicy:
    """Forwards to a `DynamicK` and adds up the host seconds spent in it and in its decisions (`clock`, a
    `bench_policy_host.Clock`, reset per run)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.max_k, self.clock = inner, inner.max_k, Clock(inner)
        self.wants_step_times = inner.wants_step_times

    def choose(self, request_ids: Sequence[str]) -> int:
        return self.clock.call(self.inner.choose, request_ids)

    def observe_acceptance(self, *args: Any) -> None:
        self.clock.call(self.inner.observe_acceptance, *args)

    def observe_step(self, *args: Any) -> None:
        self.clock.call(self.inner.observe_step, *args)

    def remove_request(self, request_id: str) -> None:
        self.clock.call(self.inner.remove_request, request_id)


class GcTimer:
    """Seconds and count of garbage collections per generation while installed, except the first one (the
    explicit full collection `run_once` makes before its timed part)."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.count = [0, 0, 0]
        self._t0 = 0.0
        self._skip = True

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._skip:
            self._skip = False
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._t0
            self.count[g] += 1


def steady_median(step_ms: list[float], ks: Optional[list[int]]) -> float:
    """Median step time over steps whose k equals the k of the 5 steps before (all steps for a fixed k)."""
    n = len(step_ms)
    idx = [i for i in range(5, n - 3) if ks is None or (i < len(ks) and len(set(ks[i - 5:i + 1])) == 1)]
    return statistics.median(step_ms[i] for i in idx) if idx else float("nan")


def run_cell(llm, name: str, batch: int, best_k: int, repeats: int, output_len: int,  # type: ignore[no-untyped-def]
             vocab: int) -> list[dict[str, Any]]:
    from speculators.dynamic import DynamicK
    from speculators.policy import FixedK

    prompts, params = workload(name, batch, output_len, vocab, 1)
    dynamic = DynamicK(K_MAX, record=True)  # its `history` is the k sequence `replay` replays
    replay = ReplayK(K_MAX)
    timed = TimedPolicy(dynamic)
    policies = {"fixed": FixedK(best_k), "shadow": ShadowK(DynamicK(K_MAX), best_k), "dynamic": timed,
                "replay": replay}
    rows = []
    for rep in range(repeats):
        for pname, policy in policies.items():
            set_policy(llm, policy)
            before = len(dynamic.history)
            timer = GcTimer()
            timed.clock.reset()
            gc.callbacks.append(timer)
            try:
                r = run_once(llm, prompts, params)
            finally:
                gc.callbacks.remove(timer)
            ks = None
            if pname == "dynamic":
                ks = dynamic.history[before:]
                replay.load(ks)
            elif pname == "replay":
                ks = replay.ks
            dyn = pname == "dynamic"
            row = {"workload": name, "batch": batch, "policy": pname, "repeat": rep,
                   "tok_per_s": round(r["output_tok_per_s"]), "steps": r["steps"],
                   "median_step_ms": r["median_step_ms"], "steady_step_ms": round(steady_median(r["step_ms"], ks), 3),
                   "median_device_ms": statistics.median([x for x in r["step_device_ms"] if x] or [0.0]),
                   "gc_ms": [round(1e3 * s, 2) for s in timer.seconds], "gc_count": timer.count,
                   "policy_us_per_step": round(1e6 * timed.clock.total / max(r["steps"], 1), 1) if dyn else None,
                   "decisions": timed.clock.decisions if dyn else None,
                   "us_per_decision": round(1e6 * timed.clock.deciding / max(timed.clock.decisions, 1)) if dyn else None,
                   "step_ms": r["step_ms"], "k": ks}
            rows.append(row)
            print(f"{name:<14}{batch:>5} {pname:<8} rep {rep}  {row['tok_per_s']:>7} tok/s  steps {row['steps']:>4}  "
                  f"median {row['median_step_ms']:.2f}  steady {row['steady_step_ms']:.2f}  device "
                  f"{row['median_device_ms']:.2f} ms  gc {row['gc_count']} {row['gc_ms']} ms"
                  + (f"  policy {row['policy_us_per_step']} us/step, {row['decisions']} decisions of "
                     f"{row['us_per_decision']} us" if dyn else ""), file=sys.stderr)
    return rows


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", nargs="+", default=["sampled:16:0", "greedy-repeat:1:5", "greedy-repeat:256:5"],
                        help="workload:batch:best_fixed_k")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--out", default="bench_results/diag_dynamic_k")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script")
    parser.add_argument("--pin-cpus", default=None, help="run on these CPUs only, e.g. 2,3")
    args = parser.parse_args(argv)
    pin_cpus(args.pin_cpus)
    cells = [(w, int(b), int(k)) for w, b, k in (c.split(":") for c in args.cells)]
    llm = build_llm(True, min(128 + 4 * args.output_len + 8, 512 if args.smoke else 1 << 20), args.smoke)
    vocab = llm.engine.loaded.vocab_size
    warm_up(llm, vocab, tuple(range(K_MAX + 1)), sorted({b for _, b, _ in cells}))
    rows = [row for w, b, k in cells for row in run_cell(llm, w, b, k, args.repeats, args.output_len, vocab)]
    print(f"{'workload':<14}{'batch':>6} {'policy':<8}{'tok/s':>8}{'steady ms':>11}{'gc ms':>8}")
    for w, b, _ in cells:
        for p in ("fixed", "shadow", "dynamic", "replay"):
            sel = [r for r in rows if (r["workload"], r["batch"], r["policy"]) == (w, b, p)]
            print(f"{w:<14}{b:>6} {p:<8}{statistics.median(r['tok_per_s'] for r in sel):>8.0f}"
                  f"{statistics.median(r['steady_step_ms'] for r in sel):>11.3f}"
                  f"{statistics.median(sum(r['gc_ms']) for r in sel):>8.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / "diag_dynamic_k.json").write_text(json.dumps({"device": device, "args": vars(args), "rows": rows}))
    print(f"results written to {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
