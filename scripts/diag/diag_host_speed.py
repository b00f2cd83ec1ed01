"""Is the host's slow state one core's or the whole machine's? Times a fixed piece of pure-Python work
(`host_speed.probe_once_us`) on every CPU at once, every `--tick` seconds for `--seconds`, one pinned process
per CPU (a light duty cycle: the probe takes ~1 ms per tick), and reads each CPU's steal time from /proc/stat
before and after.

Prints, per CPU, the median probe and the fraction of ticks it was slow (over 1.5x its fastest), and how
often the slow CPUs of one tick were all CPUs, some or none; writes every sample to `--out`/host_speed.json.

    python scripts/diag/diag_host_speed.py --seconds 20 --out /tmp/host
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
from host_speed import probe_once_us  # noqa: E402


def _sample(cpu: int, start: float, ticks: int, tick: float, queue: "mp.Queue") -> None:
    os.sched_setaffinity(0, {cpu})
    samples = []
    for i in range(ticks):
        delay = start + i * tick - time.time()
        if delay > 0:
            time.sleep(delay)
        samples.append(round(probe_once_us(), 1))
    queue.put((cpu, samples))


def steal_ticks() -> dict[int, int]:
    """Per CPU, the steal time so far (clock ticks) from /proc/stat; empty where it is unreadable."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return {}
    out = {}
    for line in lines:
        parts = line.split()
        if parts and parts[0].startswith("cpu") and parts[0] != "cpu" and len(parts) > 8:
            out[int(parts[0][3:])] = int(parts[8])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tick", type=float, default=0.1)
    parser.add_argument("--out", default="bench_results/host_speed")
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    ticks = int(args.seconds / args.tick)
    steal_before = steal_ticks()
    queue: mp.Queue = mp.Queue()
    start = time.time() + 0.5
    procs = [mp.Process(target=_sample, args=(c, start, ticks, args.tick, queue)) for c in cpus]
    for p in procs:
        p.start()
    by_cpu = dict(queue.get() for _ in procs)
    for p in procs:
        p.join()
    steal_after = steal_ticks()
    slow = {c: [x > 1.5 * min(s) for x in s] for c, s in by_cpu.items()}
    print(f"{'cpu':>4}{'median us':>11}{'fastest':>9}{'slow ticks':>12}{'steal ticks':>13}")
    for c in cpus:
        s = sorted(by_cpu[c])
        print(f"{c:>4}{s[len(s) // 2]:>11.0f}{s[0]:>9.0f}{sum(slow[c]) / len(s):>11.0%}"
              f"{steal_after.get(c, 0) - steal_before.get(c, 0):>13}")
    per_tick = [sum(slow[c][i] for c in cpus) for i in range(ticks)]
    print(f"ticks with every CPU slow {sum(n == len(cpus) for n in per_tick) / ticks:.0%}, some "
          f"{sum(0 < n < len(cpus) for n in per_tick) / ticks:.0%}, none {sum(n == 0 for n in per_tick) / ticks:.0%}")
    print("slow CPUs per tick:", "".join(str(min(n, 9)) for n in per_tick))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_speed.json").write_text(json.dumps({"tick_s": args.tick, "probe_us": by_cpu,
                                                     "steal_ticks": {c: steal_after.get(c, 0) - steal_before.get(c, 0)
                                                                     for c in cpus}}))


if __name__ == "__main__":
    main()
