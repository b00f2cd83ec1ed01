"""Whisper decoding throughput: mrv2 (V2 runner) against HF transformers `generate`, same weights, same inputs.

One HF `WhisperForConditionalGeneration` of the chosen geometry (`base` or `small`, from mrv2's presets) gets
random bf16 weights and is saved as safetensors; mrv2 loads that directory. N requests of synthetic audio
(tones plus noise, seeded, `--audio-seconds` long) go through transformers' `WhisperFeatureExtractor` once;
both engines get the same log-mel features, the same decoder prompt (start-of-transcript, en, transcribe,
no-timestamps) and decode exactly `--output-len` tokens greedily (mrv2: ignore_eos; HF: min_new_tokens =
max_new_tokens). Timed: from the features to the last token, encoder included (feature extraction is
reported separately). Prints a table, writes `whisper_bench.json` and `whisper_bench.png` into `--out`.

    python3 scripts/bench_whisper.py --geometry base --out bench_results/whisper      # ~1-2 min on an H200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SAMPLING_RATE = 16000


def build_checkpoint(geometry: str, path: Path, seed: int, device: str, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """HF Whisper of a preset geometry with random weights, saved under `path` for mrv2; returns it on `device`."""
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    from framework.models.presets import PRESETS

    p = PRESETS[f"whisper-{geometry}"]
    keys = (
        "vocab_size",
        "num_mel_bins",
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "max_source_positions",
        "max_target_positions",
        "decoder_start_token_id",
        "eos_token_id",
    )
    config = WhisperConfig(
        **{k: p[k] for k in keys}, pad_token_id=p["eos_token_id"], suppress_tokens=None, begin_suppress_tokens=None
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config).to(dtype).eval()
    g = model.generation_config
    g.decoder_start_token_id, g.eos_token_id, g.pad_token_id = (
        p["decoder_start_token_id"],
        p["eos_token_id"],
        p["eos_token_id"],
    )
    g.lang_to_id, g.task_to_id, g.no_timestamps_token_id = p["lang_to_id"], p["task_to_id"], p["no_timestamps_token_id"]
    g.is_multilingual = True
    g.suppress_tokens = g.begin_suppress_tokens = g.forced_decoder_ids = None
    model.save_pretrained(path, safe_serialization=True)
    WhisperFeatureExtractor(feature_size=p["num_mel_bins"]).save_pretrained(path)
    return model.to(device)


def synthetic_audio(n: int, seconds: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SAMPLING_RATE)) / SAMPLING_RATE
    out = []
    for _ in range(n):
        tones = sum(rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * rng.uniform(100, 4000) * t) for _ in range(3))
        out.append((tones + 0.05 * rng.standard_normal(t.shape)).astype(np.float32))
    return out


def _sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def run_mrv2(path: Path, features: torch.Tensor, args: argparse.Namespace) -> tuple[float, list[list[int]], int]:
    """(seconds, tokens, forwards of the timed run that ran eagerly: no decode CUDA graph fitted)."""
    from framework import LLM, SamplingParams

    n = features.shape[0]
    llm = LLM(
        str(path),
        device=args.device,
        dtype=args.dtype,
        runner="v2",
        max_num_seqs=min(n, args.max_num_seqs),
        max_model_len=args.output_len + 8,
        max_num_batched_tokens=8192,
        seed=0,
        max_num_encoder_tokens=args.encoder_batch * 1500,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"input_features": f} for f in features[:4]], params, use_tqdm=False)  # warm-up: kernels compile
    prompts = [{"input_features": f} for f in features]
    eager_before = llm.engine.runner.eager_forwards
    _sync(args)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == args.output_len for o in outs)
    return elapsed, [list(o.token_ids) for o in outs], llm.engine.runner.eager_forwards - eager_before


@torch.no_grad()
def run_hf(model, features: torch.Tensor, args: argparse.Namespace) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    def generate(batch: torch.Tensor) -> torch.Tensor:
        return model.generate(
            batch.to(args.device, getattr(torch, args.dtype)),
            language="en",
            task="transcribe",
            do_sample=False,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
        )

    generate(features[:4])  # warm-up
    _sync(args)
    start = time.perf_counter()
    tokens: list[list[int]] = []
    for i in range(0, features.shape[0], args.hf_batch_size):
        tokens += generate(features[i : i + args.hf_batch_size]).tolist()
    _sync(args)
    return time.perf_counter() - start, [t[-args.output_len :] for t in tokens]


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["engines"])
    values = [results["engines"][n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(5.5, 3.2))
    bars = ax.bar(names, values, color=["tab:blue", "tab:gray"][: len(names)])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values])
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"Whisper-{results['geometry']} decoding, {results['num_requests']} x "
        f"{results['audio_seconds']:.0f} s audio, {results['output_len']} tokens each",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", choices=("tiny", "base", "small"), default="base")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--audio-seconds", type=float, default=30.0)
    ap.add_argument("--output-len", type=int, default=100)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--encoder-batch", type=int, default=64, help="requests the encoder may take in one step")
    ap.add_argument("--hf-batch-size", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench_results/whisper"))
    ap.add_argument("--device", default="cuda", help="cpu only for a smoke run (e.g. --geometry tiny --num-requests 4)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_whisper.py needs a CUDA device (or --device cpu for a smoke run)")
    args.out.mkdir(parents=True, exist_ok=True)
    from transformers import WhisperFeatureExtractor

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf = build_checkpoint(args.geometry, path, args.seed, args.device, getattr(torch, args.dtype))
        audio = synthetic_audio(args.num_requests, args.audio_seconds, args.seed)
        start = time.perf_counter()
        fe = WhisperFeatureExtractor.from_pretrained(str(path))
        features = torch.from_numpy(fe(audio, sampling_rate=SAMPLING_RATE, return_tensors="np")["input_features"])
        feature_s = time.perf_counter() - start
        mrv2_s, mrv2_tokens, mrv2_eager = run_mrv2(path, features, args)
        hf_s, hf_tokens = run_hf(hf, features, args)
    total_out = args.num_requests * args.output_len
    agree = sum(a == b for a, b in zip(mrv2_tokens, hf_tokens))
    first10 = sum(a[:10] == b[:10] for a, b in zip(mrv2_tokens, hf_tokens))
    results = {
        "geometry": args.geometry,
        "num_requests": args.num_requests,
        "audio_seconds": args.audio_seconds,
        "output_len": args.output_len,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "dtype": args.dtype,
        "feature_extraction_s": feature_s,
        "hf_batch_size": args.hf_batch_size,
        "engines": {
            "mrv2 v2": {
                "seconds": mrv2_s,
                "output_tokens_per_s": total_out / mrv2_s,
                "requests_per_s": args.num_requests / mrv2_s,
                "eager_forwards": mrv2_eager,
            },
            "HF generate": {
                "seconds": hf_s,
                "output_tokens_per_s": total_out / hf_s,
                "requests_per_s": args.num_requests / hf_s,
            },
        },
        # bf16 on different kernels: near-ties may flip late in a sequence, so this is information, not a test.
        "greedy_agreement": {"identical_requests": agree, "identical_first_10_tokens": first10},
    }
    (args.out / "whisper_bench.json").write_text(json.dumps(results, indent=2))
    plot(results, args.out / "whisper_bench.png")
    print(
        f"Whisper-{args.geometry}: {args.num_requests} requests x {args.audio_seconds:.0f} s audio, "
        f"{args.output_len} output tokens each ({args.dtype}, {results['device']})"
    )
    print(f"{'engine':<14}{'seconds':>10}{'out tok/s':>12}{'req/s':>9}")
    for name, r in results["engines"].items():
        print(f"{name:<14}{r['seconds']:>10.2f}{r['output_tokens_per_s']:>12,.0f}{r['requests_per_s']:>9.1f}")
    print(
        f"speed-up: {hf_s / mrv2_s:.2f}x; identical greedy outputs: {agree}/{args.num_requests} "
        f"(first 10 tokens: {first10}); feature extraction (CPU, not timed above): {feature_s:.1f} s; "
        f"mrv2 forwards run eagerly (no decode graph): {mrv2_eager}"
    )


if __name__ == "__main__":
    main()
