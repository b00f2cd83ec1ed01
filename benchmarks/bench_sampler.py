"""Benchmark the sampler on a CUDA GPU: the fused path against the unfused stages and one read of the logits.

Shape: 256 logits rows x 151,936 tokens (Qwen3's vocabulary), float32 (155.6 MB; `--dtype bfloat16`: 77.8 MB, as
the LM head hands them to the fused path). Every request of the batch uses the same parameters; each case is
timed through `Sampler.__call__` as the runner calls it, on two kinds of logits: "peaked" (a few dozen tokens
14-26 above a Gaussian tail, like a language model's) and "flat" (Gaussian, sigma 3: large top-p sets, the fused
path's hard case).

* `read`: one plain read of the logits, the yardstick: the faster of `logits.amax(-1)` and `logits.sum(-1)`
  (each reads every element once and writes 256 floats). `copy` (read + write) is shown too.
* `fused`: `Sampler(fused=True)`: steps 8-12 in the fused kernels (step 1 folded in when no edit runs).
* `unfused`: `Sampler(fused=False)`: sanitize, division by T, `apply_top_k_top_p` (bisection), `apply_min_p`,
  `gumbel_sample`, the greedy argmax, as before the fused path.
* cases: `temp+topk+topp` (T=0.8, k=50, p=0.9, the goal's case), `+penalties` (the same with repetition 1.1,
  frequency 0.2 and presence 0.3 over a 1024-token prompt and 256 output tokens per request), `topk`,
  `topp`, `minp`, `temp` alone.

Times are medians of CUDA-graph replays (`triton.testing.do_bench`, L2 flushed between runs): GPU time with
no host launch overhead, as in a captured decode step. The eager time of the main case is printed too, and
a per-kernel breakdown (torch.profiler, eager) of the main case and of `+penalties` for both paths, and
single stages timed alone (sanitize, the penalty kernel over each row's list of seen tokens, and the same on
verification rows (64 requests x 4 rows, k = 3 drafts each, the rows counting the drafts before them; the
mean list length is printed too), division by T, the
bisection top-k/top-p (includes a clone of the logits, timed too), min-p, Gumbel, argmax, the fused steps
8-12).
Prints tables; writes `sampler_bench.json` and, if matplotlib is installed, `sampler_bench.png` into OUT_DIR.
Takes well under a minute on an H200 (mostly compiling).

    PYTHONPATH=$PWD python3 benchmarks/bench_sampler.py OUT_DIR [--rows 256] [--vocab 151936] [--plan-warps 16]
        [--group 16 --cap 1024] [--maxnreg N] [--sample-warps 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import cuda_timing  # noqa: E402

CASES = {
    "temp+topk+topp": dict(temperature=0.8, top_k=50, top_p=0.9),
    "+penalties": dict(
        temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.3
    ),
    "topk": dict(temperature=0.8, top_k=50),
    "topp": dict(temperature=0.8, top_p=0.9),
    "minp": dict(temperature=0.8, min_p=0.05),
    "temp": dict(temperature=0.8),
}
PROMPT_LEN, OUTPUT_LEN = 1024, 256


def make_logits(kind: str, rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(rows, vocab, device="cuda", generator=g) * 3
    if kind == "peaked":
        x = x * 1.5 - 4
        top = torch.randint(0, vocab, (rows, 40), device="cuda", generator=g)
        x.scatter_(1, top, torch.rand(rows, 40, device="cuda", generator=g) * 12 + 14)
    return x


def make_sampler(params: dict, rows: int, vocab: int, fused: bool):
    """A Sampler whose `rows` slots hold requests with `params` and realistic histories; its stages."""
    from framework.params.sampling_params import SamplingParams
    from framework.params.scheduler_output import NewRequestData
    from samplers.sampler import Sampler
    from samplers.states import SamplingStates

    rng = np.random.default_rng(0)
    max_len = PROMPT_LEN + OUTPUT_LEN + 1
    history = SimpleNamespace(
        all_token_ids=torch.zeros(rows, max_len, dtype=torch.int32, device="cuda"),
        prompt_len=torch.full((rows,), PROMPT_LEN, dtype=torch.int32, device="cuda"),
        prefill_len=torch.full((rows,), PROMPT_LEN + OUTPUT_LEN, dtype=torch.int32, device="cuda"),
        total_len=torch.full((rows,), PROMPT_LEN + OUTPUT_LEN, dtype=torch.int32, device="cuda"),
        draft_tokens=torch.zeros(rows, 0, dtype=torch.int32, device="cuda"),
    )
    states = SamplingStates(
        rows,
        torch.device("cuda"),
        vocab_size=vocab,
        history=history,
        num_computed_host=lambda: np.zeros(rows, dtype=np.int64),
    )
    # Zipf-like token ids: repeated tokens, as real text has.
    all_tokens = (rng.zipf(1.2, (rows, PROMPT_LEN + OUTPUT_LEN)) % vocab).astype(np.int32)
    history.all_token_ids[:, : all_tokens.shape[1]] = torch.from_numpy(all_tokens).cuda()
    for slot in range(rows):
        tokens = all_tokens[slot].tolist()
        sp = SamplingParams(seed=slot, **params)
        sp.resolve_bad_words(None)
        states.add_request(slot, NewRequestData(f"r{slot}", tokens, PROMPT_LEN, sp, slot, [], len(tokens)))
    states.apply_staged_writes()
    return Sampler(states, fused=fused), states.stages_for(np.arange(rows))


def time_graph_ms(fn: Callable[[], object]) -> float:
    return cuda_timing.time_graph_ms(fn, warmup=10, rep=60)


def time_eager_ms(fn: Callable[[], object]) -> float:
    return cuda_timing.time_eager_ms(fn, warmup=10, rep=60)


def kernel_breakdown(fn: Callable[[], object], calls: int = 10) -> dict[str, float]:
    """Mean GPU microseconds per call of each kernel `fn` launches (torch.profiler, eager)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = getattr(evt, "cuda_time_total", 0.0)
        if total > 0:
            out[evt.key[:60]] += total / calls
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def stage_times(x: torch.Tensor, idx: torch.Tensor, positions: torch.Tensor, rows: int, vocab: int) -> dict:
    """GPU microseconds of single stages on the peaked logits (graph replays), for the per-stage table."""
    from samplers.fused_sampling import sample_fused_triton
    from samplers.gumbel import gumbel_sample_triton
    from samplers.penalties import DraftContext, apply_penalties_triton
    from samplers.sanitize import sanitize_logits_triton
    from samplers.top_k_top_p import apply_min_p_triton, apply_top_k_top_p_triton

    sampler, _ = make_sampler(CASES["+penalties"], rows, vocab, fused=True)
    pen, t = sampler.states.penalties, sampler.states.params.tensors
    params = sampler.states.params.slot_params
    work = x.clone()
    top_k, top_p = t["top_k"][idx.long()], t["top_p"][idx.long()]
    min_p = torch.full((rows,), 0.05, device="cuda")
    temperature = t["temperature"][idx.long()].unsqueeze(1)
    tables = pen.tables(positions)
    # Speculation, k = 3: rows // 4 requests, each with 4 logits rows at positions total_len .. total_len + 3.
    total_len = torch.full((rows,), PROMPT_LEN + OUTPUT_LEN, dtype=torch.int32, device="cuda")
    spec_idx = (torch.arange(rows, device="cuda") // 4).int()
    spec_positions = total_len.long()[spec_idx.long()] + torch.arange(rows, device="cuda") % 4
    drafts = torch.randint(0, vocab, (rows, 3), dtype=torch.int32, device="cuda")
    spec_tables = tables._replace(drafts=DraftContext(spec_positions, total_len, drafts))
    listed = pen.counts.num_seen.float().mean().item()
    out = dict(
        sanitize=time_graph_ms(lambda: sanitize_logits_triton(work)),
        penalties_listed=time_graph_ms(lambda: apply_penalties_triton(work, idx, tables)),
        penalties_listed_k3_drafts=time_graph_ms(lambda: apply_penalties_triton(work, spec_idx, spec_tables)),
        temperature_divide=time_graph_ms(lambda: work / temperature),
        top_k_top_p_bisection=time_graph_ms(lambda: apply_top_k_top_p_triton(work.clone(), top_k, top_p)),
        clone_for_the_above=time_graph_ms(lambda: work.clone()),
        min_p=time_graph_ms(lambda: apply_min_p_triton(work.clone(), min_p)),
        gumbel_sample=time_graph_ms(lambda: gumbel_sample_triton(work, t["seed"][idx.long()], positions)),
        argmax=time_graph_ms(lambda: work.argmax(-1)),
        fused_steps_8_12=time_graph_ms(lambda: sample_fused_triton(work, idx, positions, params, all_gather=True)),
    )
    return {**{k: v * 1e3 for k, v in out.items()}, "mean_listed_tokens_per_row": listed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument(
        "--plan-warps",
        type=int,
        default=None,
        help="fused plan kernel's num_warps (default: samplers.fused_sampling.PLAN_WARPS)",
    )
    parser.add_argument("--group", type=int, default=None, help="fused_sampling.GROUP (with --cap)")
    parser.add_argument("--cap", type=int, default=None, help="fused_sampling.CAP")
    parser.add_argument("--maxnreg", type=int, default=None, help="fused_sampling.PLAN_MAXNREG")
    parser.add_argument("--sample-warps", type=int, default=None, help="fused_sampling.SAMPLE_WARPS")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="logits dtype (bfloat16: as the LM head hands them to the fused path)",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sampler needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    import samplers.fused_sampling as fused_sampling

    if args.plan_warps is not None:
        fused_sampling.PLAN_WARPS = args.plan_warps
    fused_sampling.GROUP = args.group or fused_sampling.GROUP
    fused_sampling.CAP = args.cap or fused_sampling.CAP
    fused_sampling.PLAN_MAXNREG = args.maxnreg or fused_sampling.PLAN_MAXNREG
    fused_sampling.SAMPLE_WARPS = args.sample_warps or fused_sampling.SAMPLE_WARPS
    dtype = getattr(torch, args.dtype)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    env = dict(
        gpu=props.name,
        sms=props.multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        rows=args.rows,
        vocab=args.vocab,
        dtype=args.dtype,
        sample_warps=fused_sampling.SAMPLE_WARPS,
        plan_warps=fused_sampling.PLAN_WARPS,
        group=fused_sampling.GROUP,
        cap=fused_sampling.CAP,
        maxnreg=fused_sampling.PLAN_MAXNREG,
    )
    print(f"# {env}", file=sys.stderr)
    nbytes = args.rows * args.vocab * dtype.itemsize
    logits = {kind: make_logits(kind, args.rows, args.vocab).to(dtype) for kind in ("peaked", "flat")}
    x = logits["peaked"]
    copy_dst = torch.empty_like(x)
    read = dict(
        amax=time_graph_ms(lambda: x.amax(-1)),
        sum=time_graph_ms(lambda: x.sum(-1)),
        copy=time_graph_ms(lambda: copy_dst.copy_(x)),
    )
    read_ms = min(read["amax"], read["sum"])
    print(
        f"read once: {read_ms * 1e3:.1f} us ({nbytes / read_ms / 1e9:.2f} TB/s); amax {read['amax'] * 1e3:.1f}, "
        f"sum {read['sum'] * 1e3:.1f}, copy (read+write) {read['copy'] * 1e3:.1f} us"
    )

    idx = torch.arange(args.rows, dtype=torch.int32, device="cuda")
    positions = torch.full((args.rows,), PROMPT_LEN + OUTPUT_LEN, dtype=torch.int64, device="cuda")
    results, breakdown = [], {}
    print(
        f"\n{'case':>15} {'logits':>7} {'fused us':>9} {'x read':>7} {'unfused us':>11} {'x read':>7} {'speed-up':>8}"
    )
    for case, params in CASES.items():
        by_path = {fused: make_sampler(params, args.rows, args.vocab, fused) for fused in (True, False)}
        for kind, data in logits.items():
            r = dict(case=case, logits=kind)
            for fused, (sampler, stages) in by_path.items():
                work = data.clone()  # the penalties edit it in place: replays keep penalising the same buffer

                def call(sampler=sampler, stages=stages, work=work):
                    return sampler(work, idx, positions, stages)

                r["fused_us" if fused else "unfused_us"] = time_graph_ms(call) * 1e3
                if case == "temp+topk+topp" and kind == "peaked" and fused:
                    r["fused_eager_us"] = time_eager_ms(call) * 1e3
                if case in ("temp+topk+topp", "+penalties") and kind == "peaked":
                    breakdown[f"{case} {'fused' if fused else 'unfused'}"] = kernel_breakdown(call)
                del work
            r["fused_x_read"] = r["fused_us"] / (read_ms * 1e3)
            r["unfused_x_read"] = r["unfused_us"] / (read_ms * 1e3)
            results.append(r)
            print(
                f"{case:>15} {kind:>7} {r['fused_us']:>9.1f} {r['fused_x_read']:>7.2f} {r['unfused_us']:>11.1f} "
                f"{r['unfused_x_read']:>7.2f} {r['unfused_us'] / r['fused_us']:>7.1f}x",
                flush=True,
            )
        del by_path
        torch.cuda.empty_cache()
    stages = stage_times(x.float(), idx, positions, args.rows, args.vocab)  # the single stages take float32
    timed = {k: v for k, v in stages.items() if k != "mean_listed_tokens_per_row"}
    print("\nstages alone (us): " + ", ".join(f"{k} {v:.1f}" for k, v in timed.items()))
    print(f"penalty lists: {stages['mean_listed_tokens_per_row']:.0f} seen tokens per row on average")
    main_case = next(r for r in results if r["case"] == "temp+topk+topp" and r["logits"] == "peaked")
    print(f"\neager (host launches included), temp+topk+topp peaked, fused: {main_case['fused_eager_us']:.1f} us")
    for name, kernels in breakdown.items():
        print(f"\nper kernel, {name} (us per call):")
        for kernel, us in kernels.items():
            print(f"  {us:9.1f}  {kernel}")

    out = dict(
        env=env,
        read_us=read_ms * 1e3,
        read=dict((k, v * 1e3) for k, v in read.items()),
        results=results,
        stages_us=stages,
        breakdown=breakdown,
    )
    (args.out_dir / "sampler_bench.json").write_text(json.dumps(out, indent=1))
    try:
        plot(out, args.out_dir / "sampler_bench.png")
    except ImportError:
        print("# matplotlib missing: no plot", file=sys.stderr)
    print(f"# wrote {args.out_dir / 'sampler_bench.json'}", file=sys.stderr)
    return 0


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5), sharey=False)
    for ax, kind in zip(axes, ("peaked", "flat")):
        rows = [r for r in out["results"] if r["logits"] == kind]
        pos = np.arange(len(rows))
        ax.bar(pos - 0.2, [r["fused_us"] for r in rows], 0.4, label="fused")
        ax.bar(pos + 0.2, [r["unfused_us"] for r in rows], 0.4, label="unfused")
        ax.axhline(out["read_us"], color="k", lw=1, label="one read of the logits")
        ax.axhline(2 * out["read_us"], color="k", lw=1, ls="--", label="2 reads (goal)")
        ax.set(
            xticks=pos,
            yscale="log",
            ylabel="GPU time per call (us)",
            title=f"sampler, {out['env']['rows']} x {out['env']['vocab']} fp32, {kind} logits",
        )
        ax.set_xticklabels([r["case"] for r in rows], rotation=20, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
