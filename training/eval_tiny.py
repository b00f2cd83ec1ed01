"""Evaluate the trained tiny model's speculators: acceptance length of ngram, EAGLE and MTP for k = 1..5 on
held-out code prompts, and output tokens/s with and without each speculator in the mrv2 engine.

    PYTHONPATH=$PWD python3 training/eval_tiny.py --run-dir OUT_DIR --out EVAL_DIR      # after train_tiny.py
    PYTHONPATH=$PWD python3 training/eval_tiny.py --out EVAL_DIR                         # the shipped model

Two parts, each recorded in EVAL_DIR/eval_tiny.json and printed as markdown tables on stdout:
- "simulated": greedy acceptance computed offline (training/acceptance.py) from the target's own greedy
  continuation (HF transformers, fp32) and the draft heads' full-sequence forwards; needs only torch,
  transformers and the draft-head modules.
- "engine": `LLM(config=...)` with `speculator.method` none / ngram / eagle / mtp and k = 1..5 on the GPU,
  greedy, `ignore_eos`; output tokens/s at batch 1 and at batch = all prompts, greedy equality with the run
  without speculation, and the engine's own acceptance metrics (`LLM.get_metrics()["spec_decode"]`). Needs
  the full engine (pydantic, hydra) and the speculators; a configuration the engine refuses is recorded with
  its error and the rest go on.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.acceptance import (  # noqa: E402
    acceptance_table,
    final_hidden_states,
    greedy_sequence,
    head_drafter,
    ngram_drafter,
)
from training.data import collect_corpus, held_out_prompts, stdlib_root  # noqa: E402
from training.imports import draft_head_api  # noqa: E402

# Speculator settings as `SpeculatorConfig` takes them (spec-core / eagle branches). If those names change,
# this is the one place to adjust: {"method", "num_speculative_tokens", "model" (head dir), ngram lookup sizes}.
NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 5}


def speculator_settings(method: str, k: int, head_dir: Optional[Path]) -> dict[str, Any]:
    if method == "none":
        return {"method": "none", "num_speculative_tokens": 0}
    settings: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        settings.update(NGRAM_LOOKUP)
    if method in ("eagle", "mtp"):
        settings["model"] = str(head_dir)
    return settings


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--run-dir",
        type=Path,
        default=None,
        help="output directory of train_tiny.py (default: the model shipped in the package)",
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--skip-simulated", action="store_true")
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--engine-batch1-prompts", type=int, default=4, help="prompts run one at a time for batch-1 tok/s")
    return p.parse_args(argv)


def model_dirs(run_dir: Optional[Path]) -> dict[str, Optional[Path]]:
    if run_dir is not None:
        found = {"model": run_dir / "tiny-code", "eagle": run_dir / "tiny-code-eagle", "mtp": run_dir / "tiny-code-mtp"}
    else:
        from framework.models.embedded import shipped_draft_head_dir, shipped_model_dir

        found = {
            "model": shipped_model_dir("tiny"),
            "eagle": shipped_draft_head_dir("eagle"),
            "mtp": shipped_draft_head_dir("mtp"),
        }
    return {k: (v if v is not None and (v / "config.json").is_file() else None) for k, v in found.items()}


def load_prompts(run_dir: Optional[Path], num: int) -> list[str]:
    """The held-out prompts train_tiny.py wrote, else cut again from this machine's stdlib (same split)."""
    if run_dir is not None and (run_dir / "heldout_prompts.json").is_file():
        prompts = json.loads((run_dir / "heldout_prompts.json").read_text())
    else:
        prompts = held_out_prompts(collect_corpus(stdlib_root(), 0.03).val, num=num, prompt_chars=400, seed=0)
    return prompts[:num]


def simulated_part(
    dirs: dict[str, Optional[Path]], prompts: list[str], args: argparse.Namespace, device: torch.device, ks: list[int]
) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(dirs["model"]))
    hf = AutoModelForCausalLM.from_pretrained(str(dirs["model"]), dtype=torch.float32).to(device).eval()
    config = json.loads((dirs["model"] / "config.json").read_text())  # type: ignore[operator]
    api = draft_head_api()
    heads = {}
    for kind in ("eagle", "mtp"):
        if dirs[kind] is not None:
            head = api["load_draft_head"](dirs[kind], kind, config, device=device, dtype=torch.float32)
            head.share_target_weights(hf.model.embed_tokens.weight, hf.lm_head.weight)
            heads[kind] = head
    sequences, features = [], []
    for text in prompts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        seq = greedy_sequence(hf, ids, args.max_tokens)
        sequences.append((seq, len(ids)))
        features.append(final_hidden_states(hf, seq))
    drafters: dict[str, Any] = {"ngram": lambda i: ngram_drafter(**NGRAM_LOOKUP)}
    for kind, head in heads.items():
        drafters[kind] = (lambda h: lambda i: head_drafter(h, features[i]))(head)
    return acceptance_table(sequences, drafters, ks)


def _engine_config(model_dir: Path, spec: dict[str, Any], device: str):  # type: ignore[no-untyped-def]
    from framework.config.schema import load_config

    # A fixed KV cache (4096 blocks of 16 tokens: 64 requests of the full 1024-token context, ~0.3 GB in bf16)
    # instead of a share of free GPU memory, so one engine after another sizes alike.
    return load_config(
        {
            "model": {"path": str(model_dir), "preset": None},
            "speculator": spec,
            "device": device,
            "scheduler": {"max_num_seqs": 64},
            "cache": {"num_blocks": 4096, "block_size": 16},
            "runner": {"cuda_graph_sizes": [1, 2, 4, 8, 16, 32, 64]},
        }
    )


def _timed_generate(llm, prompts: list[str], params, one_at_a_time: bool) -> tuple[list[list[int]], float]:  # type: ignore[no-untyped-def]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [list(o.token_ids) for o in outs], time.perf_counter() - start


def engine_part(
    dirs: dict[str, Optional[Path]], prompts: list[str], args: argparse.Namespace, device: torch.device, ks: list[int]
) -> dict[str, Any]:
    from framework import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    baseline: dict[str, list[list[int]]] = {}
    # The first run compiles the Triton kernels: a discarded warm-up run keeps that out of the "none" figures.
    configs = [("warmup", 0), ("none", 0)] + [(m, k) for m in ("ngram", "eagle", "mtp") for k in ks]
    for method, k in configs:
        head_dir = dirs.get(method) if method in ("eagle", "mtp") else None
        entry: dict[str, Any] = {"method": method, "k": k}
        if method in ("eagle", "mtp") and head_dir is None:
            entry["error"] = f"no {method} head directory"
            runs.append(entry)
            continue
        llm = None
        try:
            settings = speculator_settings("none" if method == "warmup" else method, k, head_dir)
            llm = LLM(
                config=_engine_config(
                    dirs["model"],
                    settings,  # type: ignore[arg-type]
                    device.type,
                )
            )
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up (kernels, allocator)
            _reset_metrics(llm)
            for name, subset, one in (
                ("batch", prompts, False),
                ("batch1", prompts[: args.engine_batch1_prompts], True),
            ):
                tokens, seconds = _timed_generate(llm, subset, params, one)
                n_out = sum(len(t) for t in tokens)
                entry[f"{name}_output_tok_s"] = round(n_out / seconds, 1)
                entry[f"{name}_size"] = 1 if one else len(subset)
                if method == "none":
                    baseline[name] = tokens
                elif name in baseline:
                    entry[f"{name}_greedy_equal"] = tokens == baseline[name]
            metrics = llm.get_metrics() if hasattr(llm, "get_metrics") else {}
            entry["metrics"] = metrics.get("spec_decode", metrics)
        except Exception as err:  # one refused configuration must not end the evaluation
            entry["error"] = f"{type(err).__name__}: {err}"
            print(traceback.format_exc(), file=sys.stderr)
        llm = None
        gc.collect()  # the engine's device memory goes before the next one starts
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if method != "warmup":
            runs.append(entry)
        print(
            f"[eval_tiny] engine {method} k={k}: {json.dumps({x: y for x, y in entry.items() if x != 'metrics'})}",
            file=sys.stderr,
            flush=True,
        )
    return {"runs": runs, "max_tokens": args.max_tokens, "num_prompts": len(prompts)}


def _reset_metrics(llm) -> None:  # type: ignore[no-untyped-def]
    metrics = getattr(getattr(llm, "engine", None), "spec_metrics", None)
    if metrics is not None and hasattr(metrics, "reset"):
        metrics.reset()


def markdown(result: dict[str, Any], ks: list[int]) -> str:
    lines = []
    sim = result.get("simulated")
    if sim:
        lines += [
            "Simulated greedy acceptance length (1 + accepted drafts per step):",
            "",
            "| method | " + " | ".join(f"k={k}" for k in ks) + " |",
            "|---|" + "---|" * len(ks),
        ]
        for method, by_k in sim.items():
            lines.append(f"| {method} | " + " | ".join(f"{by_k[k]['mean_acceptance_length']:.2f}" for k in ks) + " |")
        lines.append("")
    eng = result.get("engine")
    if eng:
        lines += [
            "Engine (greedy, ignore_eos, max_tokens per request " + str(eng["max_tokens"]) + "):",
            "",
            "| method | k | out tok/s batch | out tok/s batch 1 | acceptance length | greedy equal |",
            "|---|---|---|---|---|---|",
        ]
        for run in eng["runs"]:
            if "error" in run:
                reason = " ".join(run["error"].split())[:80].replace("|", "/")
                lines.append(f"| {run['method']} | {run['k']} | error: {reason} | | | |")
                continue
            acc = run.get("metrics", {}).get("mean_acceptance_length", "") if run["method"] != "none" else "-"
            equal = run.get("batch_greedy_equal", "") if run["method"] != "none" else "(reference)"
            lines.append(
                f"| {run['method']} | {run['k']} | {run.get('batch_output_tok_s')} | "
                f"{run.get('batch1_output_tok_s')} | {acc} | {equal} |"
            )
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    dirs = model_dirs(args.run_dir)
    if dirs["model"] is None:
        print(
            "eval_tiny: no trained model (pass --run-dir, or ship tiny-code in framework/models/embedded/)",
            file=sys.stderr,
        )
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(args.run_dir, args.num_prompts)
    result: dict[str, Any] = {
        "model": str(dirs["model"]),
        "heads": {k: str(v) for k, v in dirs.items() if k != "model"},
        "num_prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "ks": ks,
    }
    start = time.time()
    if not args.skip_simulated:
        result["simulated"] = simulated_part(dirs, prompts, args, device, ks)
        result["simulated_seconds"] = round(time.time() - start, 1)
    if not args.skip_engine:
        try:
            result["engine"] = engine_part(dirs, prompts, args, device, ks)
        except ImportError as err:
            result["engine"] = {"runs": [], "error": f"engine unavailable: {err}", "max_tokens": args.max_tokens}
    if torch.cuda.is_available():
        result["device"] = torch.cuda.get_device_name(0)
    result["wall_seconds"] = round(time.time() - start, 1)
    (args.out / "eval_tiny.json").write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result, ks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
