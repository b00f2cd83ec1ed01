"""Time the fused sampler's plan kernel (`_fused_plan_kernel`) alone, in many configurations, in one run.

Shape and data as scripts/bench_sampler.py: 256 rows x 151,936 tokens fp32, "peaked" and "flat" logits, every
row T = 0.8, top-k 50, top-p 0.9 (the goal's case). For each configuration the script runs the whole fused
sampler once (pass 1 writes the group maxima the plan reads; the plan launch is recorded), then times the
recorded plan launch alone (median of CUDA-graph replays, L2 flushed, as bench_sampler) and, for complete
plans, the whole pipeline too. Configurations (module constants of `samplers.fused_sampling`):

* `base`: the defaults (GROUP 32, CAP 2048, bisection; first pass 2 warps, ~4096 programs; plan 8 warps
  capped at 128 registers; resolve 8 warps, tiles of 32; no sample kernel when every row gathers);
* `stop1..3`: the plan ended after loading the group maxima / the cutoff / the chosen groups (each adds one
  small reduction or store to keep the step's work): differences with `base` give each step's time;
* `sample kernel`: the pipeline with the (idle) sample kernel launched, as for a batch with direct rows;
* `tileN`: RESOLVE_TILE (the resolve's pairwise tiles); `resolve wN`: RESOLVE_WARPS;
* `stats wN`: STATS_WARPS; `programs N`: TARGET_PROGRAMS (the first pass's chunking);
* `nregN`, `no nreg cap`, `w16 nreg64`, `w4 nreg255`: PLAN_WARPS / PLAN_MAXNREG (how many plans share an SM);
* `radix`, `split`, `guess`: the cutoff searches of `samplers.fused_cutoff`; `keys`: PLAN_KEYS_ONLY;
* `g16`, `g64`: GROUP 16 / 64 with CAP 1024 / 4096;
* `w16 r4 s4 p2048`: the launch shapes used before (for comparison).

Columns: plan-kernel microseconds on each kind of logits; for complete plans the pipeline's microseconds and
its ratio to one read of the logits (the goal: <= 2), the rows whose candidates fit the buffer (the others
take the slow exact path) and the rows whose token equals `sample_fused_reference`'s (every configuration must
be exact); registers, spills, shared memory and programs per SM of the compiled plan kernel (1 program per SM
on 132 SMs means 2 waves for 256 rows).

    PYTHONPATH=$PWD python3 scripts/diag_fused_plan.py [--out OUT_DIR] [--quick | --only a,b] [--rows 256] [--vocab V]
    PYTHONPATH=$PWD python3 scripts/diag_fused_plan.py --smoke    # CPU, interpreter: tiny shapes, no timings

About 1 minute on an H200, mostly compiling (27 variants); `--quick` (19 variants) a little less.
Writes OUT_DIR/diag_fused_plan.json; exits 1 if a configuration fails or matches the reference on fewer rows
than `base`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple, Optional

if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import samplers.fused_sampling as fused  # noqa: E402
from samplers.fused_sampling import SlotSamplingParams, sample_fused_reference, sample_fused_triton  # noqa: E402


class Variant(NamedTuple):
    name: str
    group: int = 32
    cap: int = 2048
    warps: int = 8
    cutoff: str = "bisect"
    keys_only: bool = False
    maxnreg: Optional[int] = 128
    stop_after: int = 0  # 0: the whole plan
    resolve_warps: int = 8
    tile: int = 32
    all_gather: bool = True  # the pipeline without the sample kernel (every row of the case gathers)
    stats_warps: int = 2
    programs: int = 4096  # TARGET_PROGRAMS of the first pass


def variants() -> list[Variant]:
    base = Variant("base")
    out = [base]
    out += [base._replace(name=f"stop{s}", stop_after=s) for s in (1, 2, 3)]
    out += [base._replace(name="sample kernel", all_gather=False)]
    out += [base._replace(name=f"tile{t}", tile=t) for t in (16, 64)]
    out += [base._replace(name=f"resolve w{w}", resolve_warps=w) for w in (2, 4, 16)]
    out += [base._replace(name=f"stats w{w}", stats_warps=w) for w in (1, 4)]
    out += [base._replace(name=f"programs {n}", programs=n) for n in (2048, 8192)]
    out += [base._replace(name=f"nreg{n}", maxnreg=n) for n in (96, 160)]
    out += [base._replace(name="no nreg cap", maxnreg=None), base._replace(name="w16 nreg64", warps=16, maxnreg=64),
            base._replace(name="w4 nreg255", warps=4, maxnreg=255)]
    out += [base._replace(name=c, cutoff=c) for c in ("radix", "split", "guess")]
    out += [base._replace(name="keys", keys_only=True), base._replace(name="guess+keys", cutoff="guess", keys_only=True)]
    out += [base._replace(name="g16", group=16, cap=1024), base._replace(name="g64", group=64, cap=4096)]
    # The defaults before 2026-12-01 (second session): 16-warp plan, no cap, 4-warp resolve, 4-warp first pass.
    out += [base._replace(name="w16 r4 s4 p2048", warps=16, maxnreg=None, resolve_warps=4, stats_warps=4,
                          programs=2048)]
    return out


QUICK = ["base", "stop1", "stop2", "stop3", "sample kernel", "tile16", "resolve w4", "resolve w16", "stats w1",
         "stats w4", "programs 2048", "programs 8192", "nreg96", "nreg160", "no nreg cap", "w4 nreg255", "guess",
         "keys", "w16 r4 s4 p2048"]


def configure(v: Variant) -> None:
    fused.GROUP, fused.CAP, fused.PLAN_WARPS = v.group, v.cap, v.warps
    fused.PLAN_CUTOFF, fused.PLAN_KEYS_ONLY, fused.PLAN_MAXNREG = v.cutoff, v.keys_only, v.maxnreg
    fused.RESOLVE_WARPS, fused.RESOLVE_TILE = v.resolve_warps, v.tile
    fused.STATS_WARPS, fused.TARGET_PROGRAMS = v.stats_warps, v.programs


def record_plan(logits: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, params: SlotSamplingParams,
                stop_after: int, all_gather: bool):
    """Runs the fused sampler once; returns (its result, a function relaunching its plan alone, the plan
    kernel's compiled object, the workspace the plan writes: `count` <= CAP marks the rows whose candidates
    fit the buffer)."""
    calls = []
    real = fused._launch_plan

    def record(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    fused._launch_plan = record
    try:
        result = sample_fused_triton(logits, idx, positions, params, all_gather=all_gather)
    finally:
        fused._launch_plan = real
    args, kwargs = calls[0]
    kwargs = dict(kwargs, stop_after=stop_after)
    compiled = real(*args, **kwargs)
    return result, (lambda: real(*args, **kwargs)), compiled, args[3]


def occupancy(compiled, warps: int) -> dict:
    """Registers, spills, shared memory of the compiled kernel and how many programs fit on one SM (H100/H200:
    64K registers, 228 KiB shared memory, 2048 threads per SM)."""
    regs = int(getattr(compiled, "n_regs", 0) or 0)
    spills = int(getattr(compiled, "n_spills", 0) or 0)
    shared = int(getattr(getattr(compiled, "metadata", None), "shared", 0) or 0)
    threads = 32 * warps
    fit = [2048 // threads, 32]
    if regs:
        fit.append(65536 // (((regs * 32 + 255) // 256) * 256 * warps))  # registers go per warp, 256 at a time
    if shared:
        fit.append(233472 // (shared + 1024))  # (1 KiB per block is reserved)
    return dict(regs=regs, spills=spills, shared=shared, per_sm=min(fit))


def make_logits_cpu(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """bench_sampler's recipe on the CPU (its own generator draws on the GPU)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 3
    if kind == "peaked":
        x = x * 1.5 - 4
        top = torch.randint(0, vocab, (rows, 40), generator=g)
        x.scatter_(1, top, torch.rand(rows, 40, generator=g) * 12 + 14)
    return x


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for diag_fused_plan.json")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, no timings")
    args = parser.parse_args(argv)
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("diag_fused_plan needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return 2
    rows = args.rows or (2 if smoke else 256)
    vocab = args.vocab or (8000 if smoke else 151936)  # (smoke: k = 50 groups of 64 still fit)
    device = "cpu" if smoke else "cuda"
    chosen = variants()
    if args.only or args.quick:
        names = args.only.split(",") if args.only else QUICK
        unknown = sorted(set(names) - {v.name for v in chosen})
        if unknown:
            raise SystemExit(f"unknown variants {unknown}: expected names from {[v.name for v in chosen]}")
        chosen = [v for v in chosen if v.name in names]
    if smoke:
        chosen = [v._replace(maxnreg=None) for v in chosen]  # (a compiler option: the interpreter has none)
        time_ms: Callable[[Callable[[], object]], float] = lambda fn: float("nan")  # noqa: E731
        logits = {kind: make_logits_cpu(kind, rows, vocab).to(device) for kind in ("peaked", "flat")}
    else:
        from bench_sampler import make_logits, time_graph_ms

        time_ms = time_graph_ms
        logits = {kind: make_logits(kind, rows, vocab) for kind in ("peaked", "flat")}
    params = SlotSamplingParams(
        torch.full((rows,), 0.8, device=device), torch.full((rows,), args.top_k, dtype=torch.int32, device=device),
        torch.full((rows,), args.top_p, device=device), torch.zeros(rows, device=device),
        torch.arange(rows, device=device) * 7919 + 1)
    idx = torch.arange(rows, dtype=torch.int32, device=device)
    positions = torch.full((rows,), 1280, dtype=torch.int64, device=device)
    expected = {kind: sample_fused_reference(x, idx, positions, params).sampled for kind, x in logits.items()}
    read_us = float("nan")
    if not smoke:
        x = logits["peaked"]
        read_us = min(time_ms(lambda: x.amax(-1)), time_ms(lambda: x.sum(-1))) * 1e3
    env = dict(device=torch.cuda.get_device_name(0) if not smoke else "cpu (interpreter)", rows=rows, vocab=vocab,
               top_k=args.top_k, top_p=args.top_p, temperature=0.8, read_us=read_us)
    print(f"# {env}", file=sys.stderr)
    head = (f"{'variant':>28} {'plan peaked':>11} {'plan flat':>9} {'pipe peaked':>11} {'pipe flat':>9} {'x read':>6} "
            f"{'fit':>7} {'exact':>7} {'regs':>4} {'spill':>5} {'smem':>6} {'prog/SM':>7}")
    print(head)
    saved = (fused.GROUP, fused.CAP, fused.PLAN_WARPS, fused.PLAN_CUTOFF, fused.PLAN_KEYS_ONLY, fused.PLAN_MAXNREG,
             fused.RESOLVE_WARPS, fused.RESOLVE_TILE, fused.STATS_WARPS, fused.TARGET_PROGRAMS)
    results = []
    started = time.time()
    for v in chosen:
        configure(v)
        r = dict(v._asdict())
        try:
            for kind, x in logits.items():
                result, plan, compiled, ws = record_plan(x, idx, positions, params, v.stop_after, v.all_gather)
                r[f"plan_{kind}_us"] = time_ms(plan) * 1e3
                if v.stop_after == 0:
                    r[f"fit_{kind}"] = int((ws.count <= v.cap).sum())
                    r[f"exact_{kind}"] = int((result.sampled == expected[kind]).sum())
                    r[f"pipeline_{kind}_us"] = time_ms(lambda: sample_fused_triton(
                        x, idx, positions, params, all_gather=v.all_gather)) * 1e3
                r.update(occupancy(compiled, v.warps))
        except Exception as exc:  # one failing variant (a compiler refusal) must not hide the others
            r["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        results.append(r)
        print(_row(r, rows, read_us), flush=True)
    (fused.GROUP, fused.CAP, fused.PLAN_WARPS, fused.PLAN_CUTOFF, fused.PLAN_KEYS_ONLY, fused.PLAN_MAXNREG,
     fused.RESOLVE_WARPS, fused.RESOLVE_TILE, fused.STATS_WARPS, fused.TARGET_PROGRAMS) = saved
    print(f"# {len(chosen)} variants in {time.time() - started:.0f} s; exact = rows equal to the reference (of "
          f"{rows} per kind), fit = rows whose candidates fit the buffer (peaked/flat)", file=sys.stderr)
    # A row whose top-p mass lies within float rounding of p * Z may differ from the reference in every
    # configuration alike (see samplers.fused_sampling): a configuration fails when it matches fewer rows.
    floor = {kind: min([r.get(f"exact_{kind}", rows) for r in results if r["name"] == "base"] or [rows])
             for kind in logits}
    bad = [r["name"] for r in results if "error" in r
           or any(r.get(f"exact_{kind}", rows) < floor[kind] for kind in logits)]
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "diag_fused_plan.json").write_text(json.dumps(dict(env=env, results=results), indent=1))
        print(f"# wrote {args.out / 'diag_fused_plan.json'}", file=sys.stderr)
    if bad:
        print(f"# FAILED (an error or a token different from the reference): {bad}", file=sys.stderr)
    return 1 if bad else 0


def _row(r: dict, rows: int, read_us: float) -> str:
    if "error" in r:
        return f"{r['name']:>28} ERROR {r['error']}"
    pipe = [r.get(f"pipeline_{kind}_us") for kind in ("peaked", "flat")]
    ratio = max(pipe) / read_us if pipe[0] is not None else None

    def num(value, width, fmt=".1f"):
        return f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}"

    fit = exact = "-"
    if "fit_peaked" in r:
        fit = f"{r['fit_peaked']}/{r['fit_flat']}"
        exact = f"{r['exact_peaked']}/{r['exact_flat']}"
    return (f"{r['name']:>28} {num(r.get('plan_peaked_us'), 11)} {num(r.get('plan_flat_us'), 9)} "
            f"{num(pipe[0], 11)} {num(pipe[1], 9)} {num(ratio, 6, '.2f')} {fit:>7} {exact:>7} "
            f"{r.get('regs', 0):>4} {r.get('spills', 0):>5} {r.get('shared', 0):>6} {r.get('per_sm', 0):>7}")


if __name__ == "__main__":
    sys.exit(main())
