"""Host time of the dynamic-k policy per step, on a simulated decode trace (no model, no device).

Each run submits `--batch` requests of `--output-len` tokens at once and decodes them until all finish, as
`scripts/bench_spec.py` does: every step the policy chooses k, sees each row's acceptance (each request
accepts each draft with its own probability, drawn from `--acceptance`), the requests that finished, and the
step time of the steady steps (the engine's rule: the same k for three steps, no request finished before).
The policy persists across runs, like an engine serving one batch after another. Reports the policy's
microseconds per step (all its calls), the decisions it made per run and what one costs; writes
`policy_host.json` into `--out`. It tells a policy change's host cost on a laptop in seconds, and the same
command on the GPU machine's host tells how that host compares.

    python scripts/bench_policy_host.py --batch 16 64 256 --out bench_results/policy_host
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from speculators.dynamic import DynamicK  # noqa: E402


class Clock:
    """Adds up the seconds spent in the policy's methods, and separately in its decisions (`best_k`)."""

    def __init__(self, policy: DynamicK) -> None:
        self.policy, self.total, self.deciding, self.decisions = policy, 0.0, 0.0, 0
        best_k = policy.best_k

        def timed_best_k(*args: Any, **kwargs: Any) -> Optional[int]:
            t0 = time.perf_counter()
            try:
                return best_k(*args, **kwargs)
            finally:
                self.deciding += time.perf_counter() - t0
                self.decisions += 1

        policy.best_k = timed_best_k  # type: ignore[method-assign]

    def reset(self) -> None:
        """Start counting afresh (the same policy, a new run)."""
        self.total, self.deciding, self.decisions = 0.0, 0.0, 0

    def call(self, method: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return method(*args)
        finally:
            self.total += time.perf_counter() - t0


def run(
    policy: DynamicK, clock: Clock, batch: int, output_len: int, acceptance: list[float], rng: random.Random, tag: str
) -> int:
    """One batch decoded to the end; returns its steps."""
    left = {f"{tag}-{i}": output_len for i in range(batch)}
    p_accept = {r: rng.choice(acceptance) for r in left}
    verified_k, last_ks, finished_before, steps = 0, [-1, -1], True, 0
    while left:
        ids = list(left)
        k = clock.call(policy.choose, ids)
        accepted = []
        for r in ids:
            a = 0
            while a < verified_k and rng.random() < p_accept[r]:
                a += 1
            accepted.append(a)
        if verified_k:
            clock.call(policy.observe_acceptance, tuple(ids), (verified_k,) * len(ids), tuple(accepted))
        if not finished_before and k == last_ks[0] == last_ks[1]:  # the rule of speculators.steady_steps.SteadySteps
            seconds = 0.002 * (1 + 0.01 * len(ids)) * (1 + (0.25 + 0.03 * k if k else 0.0)) * rng.uniform(1, 1.1)
            clock.call(policy.observe_step, len(ids), k, seconds)
        last_ks, finished_before = [k, last_ks[0]], False
        for r, a in zip(ids, accepted):
            left[r] -= 1 + a
            if left[r] <= 0:
                del left[r]
                finished_before = True
                clock.call(policy.remove_request, r)
        verified_k = k
        steps += 1
    return steps


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--runs", type=int, default=8, help="timed runs per batch size, after two untimed ones")
    parser.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        default=[0.6, 0.8, 0.9, 0.95],
        help="per-draft acceptance probabilities the requests draw from",
    )
    parser.add_argument("--out", default="bench_results/policy_host")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'batch':>6}{'steps/run':>11}{'us/step':>9}{'decisions/run':>15}{'us/decision':>13}")
    for batch in args.batch:
        rng = random.Random(batch)
        policy = DynamicK(5)
        clock = Clock(policy)
        for i in range(2):  # learning runs, untimed
            run(policy, clock, batch, args.output_len, args.acceptance, rng, f"warm{i}")
        clock.reset()
        steps = sum(
            run(policy, clock, batch, args.output_len, args.acceptance, rng, f"run{i}") for i in range(args.runs)
        )
        row = {
            "batch": batch,
            "steps_per_run": steps / args.runs,
            "us_per_step": 1e6 * clock.total / steps,
            "decisions_per_run": clock.decisions / args.runs,
            "us_per_decision": 1e6 * clock.deciding / max(clock.decisions, 1),
        }
        rows.append(row)
        print(
            f"{batch:>6}{row['steps_per_run']:>11.0f}{row['us_per_step']:>9.1f}{row['decisions_per_run']:>15.1f}"
            f"{row['us_per_decision']:>13.0f}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "policy_host.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
