"""LoRA serving cost: output tokens per second of the nano workload with requests spread over adapters, against
the base model in the same process.

The issue's targets (one H100 or H200, median of 3): on the Qwen3-0.6B geometry with requests spread over 8
rank-16 adapters on all seven projections, >= 85% of the base model's out tok/s; with 1 adapter >= 92%; on the
Qwen3-8B geometry with 8 adapters >= 90%. Random weights (the preset geometries) and random adapters written in
PEFT's layout (adapter_config.json + adapter_model.safetensors) under a temporary directory.

Each configuration is one engine (`lora.enable` off for the base; on, `lora.max_loras` = adapters, for the
others), a warm-up, then `--rounds` timed runs of the workload (random prompt ids and lengths, ignore_eos,
temperature 0.6); the median round counts. Prints a table, writes `<out>.json` and `<out>.png`.

    PYTHONPATH=$PWD python benchmarks/lora/bench_lora.py --geometry qwen3-0.6b --out lora_0.6b
    PYTHONPATH=$PWD python benchmarks/lora/bench_lora.py --geometry qwen3-8b --adapters 0 8 --out lora_8b
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import save_file

from framework.entrypoints.llm import LLM
from framework.layers.kernels import lora as lora_kernels
from framework.layers.kernels import lora_fused
from framework.models.lora.adapter import ATTENTION_PARTS
from framework.models.lora.projection import lora_targets
from framework.params.lora_request import LoRARequest
from framework.params.sampling_params import SamplingParams

RANK = 16


def write_adapters(model: torch.nn.Module, count: int, root: Path) -> list[LoRARequest]:
    """`count` random rank-16 adapters on all seven projections of `model`, in PEFT's file layout."""
    targets = lora_targets(model)
    adapters = []
    for index in range(count):
        gen = torch.Generator().manual_seed(index)
        tensors = {}
        for (layer, part), shape in targets.shapes.items():
            group = "self_attn" if part in ATTENTION_PARTS else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{part}"
            a = torch.randn(RANK, shape.in_features, generator=gen) / math.sqrt(shape.in_features)
            tensors[f"{prefix}.lora_A.weight"] = a.bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (
                torch.randn(shape.out_features, RANK, generator=gen) * 0.01
            ).bfloat16()
        path = root / f"adapter-{index}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": ["all-linear"]}
        (path / "adapter_config.json").write_text(json.dumps(config))
        adapters.append(LoRARequest(f"adapter-{index}", str(path)))
    return adapters


def workload(num_requests: int, seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The nano workload: input and output lengths uniform in [100, 1024], random ids, ignore_eos, T = 0.6."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(num_requests):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(100, 1024))])
        params.append(
            SamplingParams(temperature=0.6, max_tokens=rng.randint(100, 1024), ignore_eos=True, seed=seed + i)
        )
    return prompts, params


def run_config(geometry: str, num_adapters: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"max_model_len": 2048, "max_num_seqs": 256, "max_num_batched_tokens": 8192}
    if num_adapters:
        kwargs |= {"enable_lora": True, "max_loras": num_adapters, "max_lora_rank": RANK}
    llm = LLM(geometry, **kwargs)
    adapters = write_adapters(llm.engine.runner.model, num_adapters, root / str(num_adapters)) if num_adapters else []
    prompts, params = workload(args.requests, 0, llm.engine.loaded.vocab_size)
    loras: list[Optional[LoRARequest]] = [
        adapters[i % len(adapters)] if adapters else None for i in range(len(prompts))
    ]
    warm = SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:16], warm, use_tqdm=False, lora_request=loras[:16])
    rounds = []
    for _ in range(args.rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
        seconds = time.perf_counter() - start
        rounds.append(sum(len(o.token_ids) for o in outs) / seconds)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return {"adapters": num_adapters, "out_tok_s": statistics.median(rounds), "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--geometry", default="qwen3-0.6b", help="random-weight preset (qwen3-0.6b, qwen3-8b)")
    parser.add_argument("--adapters", type=int, nargs="+", default=[0, 1, 8], help="0 = the base model")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="lora_bench")
    parser.add_argument(
        "--split-k-max-tokens",
        type=int,
        default=None,
        help="steps of up to this many tokens take the split-K shrink (sets lora.SPLIT_K_MAX_TOKENS in this process; "
        "one GPU runs the engine here); default: the module's value",
    )
    parser.add_argument(
        "--fused-max-tokens",
        type=int,
        default=None,
        help="steps of up to this many tokens take the fused shrink + expand over tokens grouped by adapter (sets "
        "lora_fused.FUSED_MAX_TOKENS in this process); default: the module's value (0: off)",
    )
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)  # before the runs: their results must have a place
    if args.split_k_max_tokens is not None:
        lora_kernels.SPLIT_K_MAX_TOKENS = args.split_k_max_tokens
    if args.fused_max_tokens is not None:
        lora_fused.FUSED_MAX_TOKENS = args.fused_max_tokens
    with tempfile.TemporaryDirectory() as tmp:
        results = [run_config(args.geometry, n, args, Path(tmp)) for n in args.adapters]
    base = next((r["out_tok_s"] for r in results if r["adapters"] == 0), None)
    print(
        f"{torch.cuda.get_device_name()}  {args.geometry}  {args.requests} nano requests, rank {RANK}, 7 projections, "
        f"split-K shrink up to {lora_kernels.SPLIT_K_MAX_TOKENS} tokens, fused up to {lora_fused.FUSED_MAX_TOKENS}"
    )
    print(f"{'adapters':>8} {'out tok/s':>10} {'vs base':>8}  rounds")
    for r in results:
        r["ratio"] = r["out_tok_s"] / base if base else None
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        print(f"{r['adapters']:>8} {r['out_tok_s']:>10.0f} {ratio:>8}  {', '.join(f'{x:.0f}' for x in r['rounds'])}")
    meta = {"device": torch.cuda.get_device_name(), "geometry": args.geometry, "requests": args.requests, "rank": RANK}
    meta["split_k_max_tokens"] = lora_kernels.SPLIT_K_MAX_TOKENS
    meta["fused_max_tokens"] = lora_fused.FUSED_MAX_TOKENS
    Path(f"{args.out}.json").write_text(json.dumps({**meta, "results": results}, indent=2))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    labels = ["base" if r["adapters"] == 0 else f"{r['adapters']} adapter(s)" for r in results]
    ax.bar(labels, [r["out_tok_s"] for r in results], color=["#888"] + ["#3a7"] * (len(results) - 1))
    ax.set_ylabel("output tokens / s (median of rounds)")
    ax.set_title(f"LoRA rank {RANK} on 7 projections, {args.geometry}, {meta['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(f"{args.out}.png", dpi=120)
    print(f"wrote {args.out}.json, {args.out}.png")


if __name__ == "__main__":
    main()
