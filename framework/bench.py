"""`mrv2 bench`: a seeded random-prompt workload through mrv2 (and optional baselines on the same requests).

Prints a table on stdout, writes `bench.json` and `bench.png` into the output directory.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from framework.config import BenchConfig, Mrv2Config
from framework.llm import LLM
from framework.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass(frozen=True)
class BenchResult:
    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    seconds: float

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds


def make_workload(bench: BenchConfig, vocab_size: int) -> Workload:
    """Random prompt ids and output lengths, uniform in the configured ranges, from `bench.seed`."""
    rng = random.Random(bench.seed)
    vocab = min(vocab_size, 256) if vocab_size <= 512 else vocab_size  # byte-level presets: stay in bytes
    prompts, outs = [], []
    for _ in range(bench.num_requests):
        prompts.append([rng.randrange(vocab) for _ in range(rng.randint(*bench.input_len))])
        outs.append(rng.randint(*bench.output_len))
    return Workload(prompts, outs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_mrv2(llm: LLM, workload: Workload, bench: BenchConfig) -> BenchResult:
    params = [
        SamplingParams(temperature=bench.temperature, max_tokens=n, ignore_eos=True, seed=bench.seed + i)
        for i, n in enumerate(workload.output_lens)
    ]
    device = llm.engine.loaded.device
    _sync(device)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=True)
    _sync(device)
    seconds = time.perf_counter() - start
    return BenchResult(
        engine=f"mrv2 {llm.engine.runner.name}",
        num_requests=len(outputs),
        input_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=sum(len(o.token_ids) for o in outputs),
        seconds=seconds,
    )


def bench_hf(llm: LLM, workload: Workload, bench: BenchConfig) -> BenchResult:
    """HF transformers `generate` on the same weights, one request at a time (no padding effects)."""
    from tqdm import tqdm

    from framework.hf_reference import hf_model_from_mrv2

    loaded = llm.engine.loaded
    model = hf_model_from_mrv2(loaded)
    _sync(loaded.device)
    start = time.perf_counter()
    out_tokens = 0
    for prompt, n in tqdm(list(zip(workload.prompts, workload.output_lens)), desc="hf", file=sys.stderr):
        ids = torch.tensor([prompt], device=loaded.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=bench.temperature > 0, temperature=bench.temperature or None,
                             top_p=None, top_k=None, pad_token_id=0)
        out_tokens += out.shape[1] - len(prompt)
    _sync(loaded.device)
    return BenchResult("hf transformers", len(workload.prompts), sum(map(len, workload.prompts)), out_tokens,
                       time.perf_counter() - start)


def format_table(results: list[BenchResult]) -> str:
    head = f"{'engine':<18}{'requests':>9}{'in tok':>10}{'out tok':>10}{'seconds':>10}{'out tok/s':>12}{'total tok/s':>13}"
    rows = [
        f"{r.engine:<18}{r.num_requests:>9}{r.input_tokens:>10}{r.output_tokens:>10}{r.seconds:>10.2f}"
        f"{r.output_tok_per_s:>12.1f}{r.total_tok_per_s:>13.1f}"
        for r in results
    ]
    return "\n".join([head, "-" * len(head), *rows])


def write_results(results: list[BenchResult], config: Mrv2Config, out_dir: Path) -> None:
    """bench.json (config + results) and bench.png (throughput bars) in `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        "config": config.model_dump(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "results": [asdict(r) | {"output_tok_per_s": r.output_tok_per_s, "total_tok_per_s": r.total_tok_per_s}
                    for r in results],
    }
    (out_dir / "bench.json").write_text(json.dumps(payload, indent=2))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = [r.engine for r in results]
    ax.bar(names, [r.output_tok_per_s for r in results], label="output tok/s")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"mrv2 bench '{config.bench.name}' ({config.bench.num_requests} requests)")
    fig.tight_layout()
    fig.savefig(out_dir / "bench.png", dpi=120)
    plt.close(fig)


def run_bench(config: Mrv2Config, out_dir: Path) -> list[BenchResult]:
    """Run the workload through mrv2 and each baseline; print the table; write JSON and plot."""
    llm = LLM(config=config)
    workload = make_workload(config.bench, llm.engine.loaded.vocab_size)
    results = [bench_mrv2(llm, workload, config.bench)]
    if "hf" in config.bench.baselines:
        results.append(bench_hf(llm, workload, config.bench))
    print(format_table(results))
    write_results(results, config, out_dir)
    print(f"results written to {out_dir}", file=sys.stderr)
    return results
