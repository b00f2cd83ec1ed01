"""`mrv2 bench`: a seeded random-prompt workload through mrv2 (and optional baselines on the same requests).

Prints a table on stdout, writes `bench.json` and `bench.png` into the output directory.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from framework.config.schema import BenchConfig, Mrv2Config
from framework.engine.request import RequestOutput
from framework.entrypoints.bench.counters import BenchCounters
from framework.entrypoints.bench.kv_footprint import KVFootprint, format_kv_footprint
from framework.entrypoints.bench.plot import write_results
from framework.entrypoints.bench.timeline import StepRecord, start_recording, stop_recording, write_timeline
from framework.entrypoints.bench.triton_compiles import compiled_variants, new_variants
from framework.entrypoints.llm import LLM
from framework.models.interface import MambaHybrid
from framework.params.sampling_params import SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


@dataclass(frozen=True)
class BenchResult:
    """One engine's run of the workload; rates are derived, TTFT and prefix-cache fields are mrv2 only."""

    engine: str
    num_requests: int
    input_tokens: int
    output_tokens: int
    seconds: float
    # Time to first token per request (all requests arrive at the start), mrv2 only: mean / median / p90 / max.
    ttft_mean_s: Optional[float] = None
    ttft_p50_s: Optional[float] = None
    ttft_p90_s: Optional[float] = None
    ttft_max_s: Optional[float] = None
    prefix_cache_queries: Optional[int] = None  # prompt tokens looked up in the prefix cache during the run
    prefix_cache_hits: Optional[int] = None  # of them, served from the cache
    # Triton kernel variants compiled during the timed run (kernel -> count): should be empty after the warm-up.
    compiles_during_run: Optional[dict[str, int]] = None
    # Forwards of the timed run that ran eagerly (no captured decode graph fits: prefills, mixed steps), mrv2 only.
    eager_forwards: Optional[int] = None
    # Steps of the timed run replayed whole as one graph (runner.full_step_cuda_graphs), mrv2 V2 only.
    full_step_replays: Optional[int] = None
    # Steps of the timed run whose forward replayed the prefill graph pieces (runner.prefill_cuda_graphs), V2 only.
    prefill_piece_steps: Optional[int] = None
    ttft_s: Optional[list[float]] = None  # per request, sorted (the plot's latency distribution), mrv2 only
    # KV footprint of the timed run, mrv2 only (framework/entrypoints/bench/kv_footprint.py): the most KV block ids
    # in use at one step (every KV group's), the bytes of one block id, their product, the tokens the running
    # requests held at that step, and the bytes per such token.
    kv_peak_blocks: Optional[int] = None
    kv_block_bytes: Optional[int] = None
    kv_peak_bytes: Optional[int] = None
    kv_tokens_at_peak: Optional[int] = None
    kv_bytes_per_token: Optional[float] = None

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.seconds

    @property
    def prefix_cache_hit_rate(self) -> Optional[float]:
        if self.prefix_cache_queries is None or self.prefix_cache_hits is None:
            return None
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def ttft_summary(outputs: list[RequestOutput]) -> dict[str, Any]:
    """Mean, median, p90 and max time to first token (seconds) over the outputs that produced a token, and every
    request's (sorted)."""
    ttfts = sorted(
        t for o in outputs if o.metrics is not None for t in [o.metrics.time_to_first_token] if t is not None
    )
    if not ttfts:
        return {}

    def quantile(q: float) -> float:
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]

    return {
        "ttft_mean_s": sum(ttfts) / len(ttfts),
        "ttft_p50_s": quantile(0.5),
        "ttft_p90_s": quantile(0.9),
        "ttft_max_s": ttfts[-1],
        "ttft_s": ttfts,
    }


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


def warm_up(llm: LLM, bench: BenchConfig) -> None:
    """Run `bench.warmup_requests` untimed requests drawn like the workload (another seed, <= 16 output tokens),
    then forget the blocks they cached."""
    if not bench.warmup_requests:
        return
    warm = bench.model_copy(
        update={
            "num_requests": bench.warmup_requests,
            "seed": bench.seed + 1_000_003,
            "output_len": (min(bench.output_len[0], 16), min(bench.output_len[1], 16)),
        }
    )
    workload = make_workload(warm, llm.engine.loaded.vocab_size)
    params = [
        SamplingParams(temperature=bench.temperature, max_tokens=n, ignore_eos=True, seed=i)
        for i, n in enumerate(workload.output_lens)
    ]
    llm.generate(workload.prompts, params, use_tqdm=False)
    llm.reset_prefix_cache()  # the timed run starts from an empty prefix cache


def bench_mrv2(
    llm: LLM, workload: Workload, bench: BenchConfig, timeline: Optional[list[StepRecord]] = None
) -> BenchResult:
    """The workload through `llm` after a warm-up, timed from submission to the last output.

    With a `timeline` list (GPU), the timed run's steps are appended to it (framework/entrypoints/bench/timeline.py).
    """
    params = [
        SamplingParams(temperature=bench.temperature, max_tokens=n, ignore_eos=True, seed=bench.seed + i)
        for i, n in enumerate(workload.output_lens)
    ]
    device = llm.engine.loaded.device
    warm_up(llm, bench)
    stats_before = llm.prefix_cache_stats
    compiled_before = compiled_variants()
    eager_before = getattr(llm.engine.runner, "eager_forwards", 0)
    footprint = KVFootprint.of_engine(llm.engine)
    counters = BenchCounters(kv_footprint=footprint)  # graph replays, KV footprint (and steps, for the timeline)
    llm.engine.set_observer(counters)
    _sync(device)
    if timeline is not None:
        start_recording(llm, counters)
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=True)
    _sync(device)
    seconds = time.perf_counter() - start
    if timeline is not None:
        timeline.extend(stop_recording(llm, counters))
    llm.engine.set_observer(None)
    eager = getattr(llm.engine.runner, "eager_forwards", None)
    graphs_counted = llm.engine.runner.name == "v2"  # V1 has no full-step graphs or prefill pieces: null fields
    stats = llm.prefix_cache_stats
    caching = llm.engine.kv_cache.enable_prefix_caching
    return BenchResult(
        engine=f"mrv2 {llm.engine.runner.name}" + ("" if caching else " (no prefix cache)"),
        num_requests=len(outputs),
        input_tokens=sum(len(p) for p in workload.prompts),
        output_tokens=sum(len(o.token_ids) for o in outputs),
        seconds=seconds,
        prefix_cache_queries=stats.queries - stats_before.queries,
        prefix_cache_hits=stats.hits - stats_before.hits,
        compiles_during_run=new_variants(compiled_before, compiled_variants()),
        eager_forwards=eager - eager_before if eager is not None else None,
        full_step_replays=counters.full_step_replays if graphs_counted else None,
        prefill_piece_steps=counters.prefill_piece_steps if graphs_counted else None,
        **ttft_summary(outputs),
        **footprint.summary().result_fields(),
    )


def bench_hf(llm: LLM, workload: Workload, bench: BenchConfig) -> BenchResult:
    """HF transformers `generate` on the same weights and requests, in left-padded batches of `hf_batch_size`.

    A batch runs until its longest request is done; only each request's own output length is counted, so
    the work HF spends past a request's end counts against it, as it would in a real deployment.
    """
    from tqdm import tqdm

    from framework.entrypoints.bench.hf_reference import hf_model_from_mrv2

    loaded = llm.engine.loaded
    model = hf_model_from_mrv2(loaded)
    order = sorted(range(len(workload.prompts)), key=lambda i: workload.output_lens[i])  # similar lengths together
    batches = [order[i : i + bench.hf_batch_size] for i in range(0, len(order), bench.hf_batch_size)]
    _sync(loaded.device)
    start = time.perf_counter()
    for batch in tqdm(batches, desc="hf generate", unit="batch", file=sys.stderr):
        width = max(len(workload.prompts[i]) for i in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(batch):  # left padding
            p = workload.prompts[i]
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        n = max(workload.output_lens[i] for i in batch)
        with torch.inference_mode():
            model.generate(
                ids.to(loaded.device),
                attention_mask=mask.to(loaded.device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=bench.temperature > 0,
                temperature=bench.temperature or None,
                top_p=None,
                top_k=None,
                pad_token_id=0,
            )
    _sync(loaded.device)
    return BenchResult(
        "hf transformers",
        len(workload.prompts),
        sum(map(len, workload.prompts)),
        sum(workload.output_lens),
        time.perf_counter() - start,
    )


def decode_idle_fraction(llm: LLM, batch_size: int, steps: int) -> dict[str, float]:
    """Fraction of wall time the GPU is idle between decode steps at `batch_size` running requests.

    Busy time per step is measured with CUDA events around the step's device work; idle = 1 - busy / wall.
    """
    engine = llm.engine
    for i in range(batch_size):
        engine.add_request(
            f"idle-{i}",
            [(i * 7 + j) % 250 for j in range(32)],
            SamplingParams(temperature=0.6, max_tokens=steps + 64, ignore_eos=True, seed=i),
        )
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill everything first: only decode steps are measured
    for _ in range(3):
        engine.step()
    runner = engine.runner
    runner.step_events = []
    _sync(engine.loaded.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.loaded.device)
    wall = time.perf_counter() - start
    events, runner.step_events = runner.step_events, None
    busy = sum(a.elapsed_time(b) for a, b in events) / 1e3
    for i in range(batch_size):
        engine.abort_request(f"idle-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "batch_size": batch_size,
        "steps": steps,
        "wall_s": wall,
        "gpu_busy_s": busy,
        "idle_fraction": max(0.0, 1 - busy / wall),
        "step_ms": wall / steps * 1e3,
    }


def hf_mamba_kernels() -> dict[str, bool]:
    """Which optional fast Mamba packages HF transformers could use here (without them it runs PyTorch loops)."""
    import importlib.util

    return {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d")}


def format_table(results: list[BenchResult]) -> str:
    width = max(18, *(len(r.engine) + 2 for r in results))
    head = (
        f"{'engine':<{width}}{'requests':>9}{'in tok':>10}{'out tok':>10}{'seconds':>10}{'out tok/s':>12}"
        f"{'total tok/s':>13}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'cache hit':>11}"
    )

    def opt(value: Optional[float], scale: float, fmt: str) -> str:
        return "-" if value is None else format(value * scale, fmt)

    rows = [
        f"{r.engine:<{width}}{r.num_requests:>9}{r.input_tokens:>10}{r.output_tokens:>10}{r.seconds:>10.2f}"
        f"{r.output_tok_per_s:>12.1f}{r.total_tok_per_s:>13.1f}{opt(r.ttft_p50_s, 1e3, '.1f'):>13}"
        f"{opt(r.ttft_p90_s, 1e3, '.1f'):>13}"
        f"{opt(r.prefix_cache_hit_rate, 100, '.1f') + ('%' if r.prefix_cache_hit_rate is not None else ''):>11}"
        for r in results
    ]
    return "\n".join([head, "-" * len(head), *rows])


def format_spec_metrics(spec: dict) -> str:
    """One line of speculative decoding counters (see `SpecDecodeMetrics.as_dict`)."""
    per_pos = " ".join(f"{x:.2f}" for x in spec["per_position_acceptance"])
    return (
        f"spec decode: {spec['num_drafts']} drafts, {spec['num_draft_tokens']} draft tokens, "
        f"{spec['num_accepted_tokens']} accepted ({100 * spec['acceptance_rate']:.1f}%), mean acceptance length "
        f"{spec['mean_acceptance_length']:.2f}, per position [{per_pos}]"
    )


def result_dict(r: BenchResult) -> dict:
    """A result with its derived rates, for the JSON file."""
    return asdict(r) | {
        "output_tok_per_s": r.output_tok_per_s,
        "total_tok_per_s": r.total_tok_per_s,
        "prefix_cache_hit_rate": r.prefix_cache_hit_rate,
    }


def graphs_expected(config: Mrv2Config, on_gpu: bool) -> bool:
    """Whether forwards should replay CUDA graphs: only then is a count of eager forwards worth a line (on a CPU
    every forward is eager, by design)."""
    return on_gpu and config.runner.cuda_graphs


def run_bench(config: Mrv2Config, out_dir: Path) -> list[BenchResult]:
    """Run the workload through mrv2 and each baseline; print the table; write JSON and plot."""
    llm = LLM(config=config)
    workload = make_workload(config.bench, llm.engine.loaded.vocab_size)
    on_gpu = llm.engine.loaded.device.type == "cuda"
    timeline: Optional[list[StepRecord]] = [] if config.bench.step_timeline and on_gpu else None
    if config.bench.step_timeline and not on_gpu:
        print("note: bench.step_timeline needs a GPU (CUDA events time the steps): no timeline recorded")
    results = [bench_mrv2(llm, workload, config.bench, timeline)]
    print(format_table(results), flush=True)  # before the baselines: a failing baseline cannot hide it
    if results[0].kv_peak_blocks is not None:
        print(format_kv_footprint(results[0].kv_peak_blocks, results[0].kv_block_bytes, results[0].kv_tokens_at_peak))
    if timeline is not None:
        print("where the timed run's device time went:\n" + write_timeline(llm, timeline, results[0].seconds, out_dir))
    if results[0].compiles_during_run:
        print(f"note: Triton compiled kernels during the timed run: {results[0].compiles_during_run}")
    if results[0].eager_forwards is not None and graphs_expected(config, on_gpu):
        print(
            f"forwards run eagerly during the timed run (no decode graph or prefill pieces): "
            f"{results[0].eager_forwards}"
        )
    if results[0].prefill_piece_steps:
        print(
            f"steps whose forward replayed prefill graph pieces (runner.prefill_cuda_graphs): "
            f"{results[0].prefill_piece_steps}"
        )
    if results[0].full_step_replays:
        print(f"steps replayed whole as one graph (runner.full_step_cuda_graphs): {results[0].full_step_replays}")
    extra: dict = {}
    spec = llm.get_metrics()["spec_decode"]
    if config.bench.decode_idle_batch and llm.engine.loaded.device.type == "cuda":
        extra["decode_idle"] = decode_idle_fraction(llm, config.bench.decode_idle_batch, steps=200)
        d = extra["decode_idle"]
        print(
            f"decode at batch {d['batch_size']}: {d['step_ms']:.2f} ms/step, GPU idle {100 * d['idle_fraction']:.1f}%"
        )
    if "hf" in config.bench.baselines:
        llm.shutdown()  # HF gets the device memory that mrv2's KV cache held
        results.append(bench_hf(llm, workload, config.bench))
        print(format_table(results))
    if config.speculator.method != "none":
        extra["spec_decode"] = spec
        print(format_spec_metrics(spec))
    if "hf" in config.bench.baselines and isinstance(llm.engine.runner.model, MambaHybrid):
        extra["hf_mamba_kernels"] = hf_mamba_kernels()
        if not all(extra["hf_mamba_kernels"].values()):
            print(
                "note: HF transformers ran Mamba layers on its slow PyTorch path (mamba_ssm / causal_conv1d "
                f"not installed: {extra['hf_mamba_kernels']})"
            )
    write_results(results, config, out_dir, extra)
    print(f"results written to {out_dir}", file=sys.stderr)
    return results
