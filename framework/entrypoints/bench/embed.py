"""`mrv2 bench task=embed`: embedding throughput (inputs/s, tokens/s) on seeded random-length inputs.

The inputs are `bench.num_requests` random prompts with lengths uniform in `bench.input_len` (the same
generator as `mrv2 bench`). With `bench.baselines: [hf]`, HF transformers embeds the same inputs in
right-padded batches of `bench.hf_batch_size` (the base model's last hidden state, pooled the same way), and
the largest difference between the two engines' vectors is reported. Prints a table on stdout, writes
`embed_bench.json` and `embed_bench.png` into the output directory.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from framework.config.schema import Mrv2Config
from framework.entrypoints.bench.throughput import _sync, make_workload
from framework.entrypoints.llm import LLM
from framework.params.pooling_params import PoolingParams


@dataclass(frozen=True)
class EmbedBenchResult:
    engine: str
    num_inputs: int
    input_tokens: int
    seconds: float

    @property
    def inputs_per_s(self) -> float:
        return self.num_inputs / self.seconds

    @property
    def tok_per_s(self) -> float:
        return self.input_tokens / self.seconds


def bench_mrv2_embed(llm: LLM, prompts: list[list[int]]) -> tuple[EmbedBenchResult, torch.Tensor]:
    """Embed every input with `LLM.encode`; returns the timing and the [N, hidden] vectors."""
    device = llm.engine.loaded.device
    llm.encode(prompts[:1], use_tqdm=False)  # warm-up: first-step allocations are not throughput
    _sync(device)
    start = time.perf_counter()
    outputs = llm.encode(prompts, PoolingParams(), use_tqdm=True)
    _sync(device)
    seconds = time.perf_counter() - start
    result = EmbedBenchResult(f"mrv2 {llm.engine.runner.name}", len(outputs), sum(map(len, prompts)), seconds)
    return result, torch.tensor([o.embedding for o in outputs])


def bench_hf_embed(llm: LLM, prompts: list[list[int]], batch_size: int) -> tuple[EmbedBenchResult, torch.Tensor]:
    """HF transformers on the same weights: right-padded batches (causal attention: padding at the end changes
    no real position), pooled as `model.pooling` says, L2-normalised."""
    from framework.entrypoints.bench.hf_reference import hf_model_from_mrv2

    loaded = llm.engine.loaded
    base = hf_model_from_mrv2(loaded).model
    pooling = llm.config.model.pooling
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths together: less padding
    vectors = torch.zeros(len(prompts), int(loaded.hf_config["hidden_size"]))
    _sync(loaded.device)
    start = time.perf_counter()
    for first in range(0, len(order), batch_size):
        batch = order[first : first + batch_size]
        lens = torch.tensor([len(prompts[i]) for i in batch])
        ids = torch.zeros(len(batch), int(lens.max()), dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
        mask = (torch.arange(ids.shape[1])[None, :] < lens[:, None]).long()
        with torch.inference_mode():
            hidden = base(ids.to(loaded.device), attention_mask=mask.to(loaded.device)).last_hidden_state.float()
        mask_d = mask.to(hidden.device)
        if pooling == "mean":
            pooled = (hidden * mask_d[..., None]).sum(1) / mask_d.sum(1, keepdim=True)
        elif pooling == "cls":
            pooled = hidden[:, 0]
        else:
            pooled = hidden[torch.arange(len(batch), device=hidden.device), lens.to(hidden.device) - 1]
        vectors[batch] = torch.nn.functional.normalize(pooled, dim=-1).cpu()
    _sync(loaded.device)
    seconds = time.perf_counter() - start
    return EmbedBenchResult("hf transformers", len(prompts), sum(map(len, prompts)), seconds), vectors


def format_table(results: list[EmbedBenchResult]) -> str:
    head = f"{'engine':<18}{'inputs':>8}{'in tok':>10}{'seconds':>10}{'inputs/s':>12}{'tok/s':>12}"
    rows = [
        f"{r.engine:<18}{r.num_inputs:>8}{r.input_tokens:>10}{r.seconds:>10.2f}{r.inputs_per_s:>12.1f}"
        f"{r.tok_per_s:>12.1f}"
        for r in results
    ]
    return "\n".join([head, "-" * len(head), *rows])


def write_results(results: list[EmbedBenchResult], config: Mrv2Config, out_dir: Path, extra: dict) -> None:
    """embed_bench.json (config + results) and embed_bench.png (inputs/s bars) in `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [asdict(r) | {"inputs_per_s": r.inputs_per_s, "tok_per_s": r.tok_per_s} for r in results],
        **extra,
    }
    (out_dir / "embed_bench.json").write_text(json.dumps(payload, indent=2))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar([r.engine for r in results], [r.inputs_per_s for r in results])
    ax.set_ylabel("inputs / s")
    ax.set_title(f"mrv2 embed bench '{config.bench.name}' ({config.bench.num_requests} inputs)")
    fig.tight_layout()
    fig.savefig(out_dir / "embed_bench.png", dpi=120)
    plt.close(fig)


def run_embed_bench(config: Mrv2Config, out_dir: Path) -> list[EmbedBenchResult]:
    """Embed the workload's prompts with mrv2 and each baseline; print the table; write JSON and plot."""
    llm = LLM(config=config)
    prompts = make_workload(config.bench, llm.engine.loaded.vocab_size).prompts
    result, vectors = bench_mrv2_embed(llm, prompts)
    results, extra = [result], {"pooling": config.model.pooling}
    if "hf" in config.bench.baselines:
        hf_result, hf_vectors = bench_hf_embed(llm, prompts, config.bench.hf_batch_size)
        results.append(hf_result)
        extra["max_abs_diff_vs_hf"] = float((vectors - hf_vectors).abs().max())
    print(format_table(results))
    if "max_abs_diff_vs_hf" in extra:
        print(f"max |mrv2 - hf| over all vectors: {extra['max_abs_diff_vs_hf']:.2e}")
    write_results(results, config, out_dir, extra)
    print(f"results written to {out_dir}", file=sys.stderr)
    return results
