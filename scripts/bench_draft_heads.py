"""Draft-head speculators (EAGLE, EAGLE-3, MTP) on the GPU: drafting cost and, with trained heads, acceptance.

Two parts, each at 1, 16, 64 and 256 requests at once, greedy, k = 3 (`--k`):

* `overhead`: the "nano" Qwen3-0.6B geometry with random bf16 weights and random heads of each kind. Random
  heads are almost never accepted, so the drop in output tokens/s against no speculation is what drafting
  and verifying cost (the first pass over the step's tokens plus k - 1 single-token steps).
* `trained`: a target and its trained heads (`--target`, `--eagle`, `--eagle3`, `--mtp`; by default the
  embedded `tiny-code` model and its heads under framework/models/embedded/ when they exist) on prompts cut
  from Python standard-library sources. Reports mean acceptance length, per-position acceptance, output
  tokens/s, and whether the output equals the run without speculation token for token.

Writes `bench_draft_heads.json` into `--out` and prints a table. About 3-4 minutes on one H200.

    python scripts/bench_draft_heads.py --out bench_results/draft_heads
    python scripts/bench_draft_heads.py --smoke --out /tmp/dh   # CPU: checks the script, no figures
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH_SIZES = (1, 16, 64, 256)
EMBEDDED = ROOT / "framework" / "models" / "embedded"


def random_head_dir(kind: str, target_config: dict[str, Any], root: Path) -> Path:
    """A head of `kind` for the target, N(0, 0.02) weights and unit norms, saved under `root/kind`."""
    from speculators.draft_heads import HEAD_CLASSES, head_config

    layers = int(target_config["num_hidden_layers"])
    aux = [0, layers // 2, layers - 1] if layers < 5 else None  # the default (2, L // 2, L - 3) needs 5+ layers
    config = head_config(kind, target_config, aux_layer_ids=aux)
    head = HEAD_CLASSES[kind].from_tensor_names(config, set())  # type: ignore[attr-defined]
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else 0.02 * torch.randn(p.shape, generator=gen))
    head.save_pretrained(root / kind)
    return root / kind


def build_llm(model: dict[str, Any], spec: dict[str, Any], device: str, max_model_len: int):  # type: ignore[no-untyped-def]
    from framework import LLM
    from framework.config.schema import load_config

    return LLM(
        config=load_config(
            {
                "model": {**model, "max_model_len": max_model_len},
                "device": device,
                "seed": 0,
                "scheduler": {"max_num_seqs": max(BATCH_SIZES), "max_num_batched_tokens": 8192},
                "runner": {"cuda_graph_sizes": list(BATCH_SIZES)},
                "speculator": spec,
            }
        )
    )


def timed(llm, prompts: list, max_tokens: int) -> tuple[list[list[int]], dict[str, Any]]:  # type: ignore[no-untyped-def]
    from framework import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.engine.spec_metrics.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    return tokens, {
        "seconds": round(seconds, 4),
        "output_tok_per_s": round(n / seconds, 1),
        **llm.get_metrics()["spec_decode"],
    }


def code_prompts(num: int, lines: int = 12) -> list[str]:
    """The first `lines` lines of `num` standard-library modules (sorted, so the same on every machine)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::3][:num]
    return ["".join(f.read_text(errors="replace").splitlines(keepends=True)[:lines]) for f in files]


def run_part(
    name: str,
    model: dict[str, Any],
    heads: dict[str, Path],
    prompts: list,
    args: argparse.Namespace,
    device: str,
    results: list[dict[str, Any]],
) -> None:
    engines = [("none", {"method": "none"})] + [
        (kind, {"method": kind, "num_speculative_tokens": args.k, "model": str(path)}) for kind, path in heads.items()
    ]
    baseline: dict[int, list[list[int]]] = {}
    for engine, spec in engines:
        llm = build_llm(model, spec, device, args.max_model_len)
        timed(llm, prompts[:2], 8)  # warm-up
        for batch in args.batch_sizes:
            subset = (prompts * (batch // len(prompts) + 1))[:batch]
            tokens, r = timed(llm, subset, args.output_len)
            if engine == "none":
                baseline[batch] = tokens
            row = {
                "part": name,
                "engine": engine,
                "batch": batch,
                "k": 0 if engine == "none" else args.k,
                **r,
                "greedy_equal": tokens == baseline[batch],
            }
            results.append(row)
            print(
                f"{name:<9}{engine:<8}{batch:>5}{r['output_tok_per_s']:>11.0f} tok/s  accept len "
                f"{r['mean_acceptance_length']:.2f}  equal {row['greedy_equal']}",
                file=sys.stderr,
                flush=True,
            )
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="bench_results/draft_heads")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--parts", nargs="+", default=["overhead", "trained"])
    p.add_argument("--target", type=Path, default=EMBEDDED / "tiny-code")
    for kind in ("eagle", "eagle3", "mtp"):
        p.add_argument(f"--{kind}", type=Path, default=EMBEDDED / f"tiny-code-{kind}")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU: checks the script, no figures")
    args = p.parse_args(argv)
    if not torch.cuda.is_available() and not args.smoke:
        sys.exit("bench_draft_heads.py needs a CUDA device (or --smoke)")
    device = "cpu" if args.smoke else "cuda"
    if args.smoke:
        args.batch_sizes, args.output_len, args.max_model_len = [1, 4], 12, 256
    from framework.models.presets import preset_config

    results: list[dict[str, Any]] = []
    if "overhead" in args.parts:
        preset = "tiny" if args.smoke else "qwen3-0.6b"
        target_config = preset_config(preset)
        with tempfile.TemporaryDirectory() as tmp:
            heads = {kind: random_head_dir(kind, target_config, Path(tmp)) for kind in ("eagle", "eagle3", "mtp")}
            gen = torch.Generator().manual_seed(1)
            prompts = [torch.randint(0, 256, (64,), generator=gen).tolist() for _ in range(16)]
            run_part("overhead", {"preset": preset}, heads, prompts, args, device, results)
    if "trained" in args.parts:
        heads = {
            k: getattr(args, k) for k in ("eagle", "eagle3", "mtp") if (getattr(args, k) / "config.json").is_file()
        }
        if not (args.target / "config.json").is_file() or not heads:
            print(f"trained: skipped (no target at {args.target} or no head next to it)", file=sys.stderr)
        else:
            run_part(
                "trained", {"path": str(args.target), "preset": None}, heads, code_prompts(16), args, device, results
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    (out / "bench_draft_heads.json").write_text(
        json.dumps({"device": name, "args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1)
    )
    print_table(results)


def print_table(results: list[dict[str, Any]]) -> None:
    head = f"{'part':<9}{'engine':<8}{'batch':>6}{'out tok/s':>11}{'vs none':>9}{'acc len':>9}  equal  per-position"
    print(head)
    print("-" * len(head))
    base = {(r["part"], r["batch"]): r["output_tok_per_s"] for r in results if r["engine"] == "none"}
    for r in results:
        rel = r["output_tok_per_s"] / base[(r["part"], r["batch"])]
        per_pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"])
        print(
            f"{r['part']:<9}{r['engine']:<8}{r['batch']:>6}{r['output_tok_per_s']:>11.0f}{rel:>8.2f}x"
            f"{r['mean_acceptance_length']:>9.2f}  {str(r['greedy_equal']):<6} [{per_pos}]"
        )


if __name__ == "__main__":
    main()
