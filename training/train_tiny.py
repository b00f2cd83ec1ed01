"""Train mrv2's embedded `tiny` model: a byte-level BPE tokenizer and a small Qwen3-architecture model on the
Python standard library's sources, then an EAGLE head and an MTP head for it. Seeded; time-budgeted.

    python3 training/train_tiny.py --out OUT_DIR            # the GPU run (~8.5 minutes on one H200)
    python3 training/train_tiny.py --out /tmp/t --smoke     # the whole pipeline in ~20 s on a CPU

Needs torch, transformers, tokenizers, safetensors and numpy (matplotlib for the plot, optional); no network.
Writes, under OUT_DIR:
    tiny-code/          config.json, model.safetensors (bf16), generation_config.json, tokenizer.json,
                        tokenizer_config.json, special_tokens_map.json      -> framework/models/embedded/
    tiny-code-eagle/    config.json, model.safetensors (EAGLE-1 head)       -> framework/models/embedded/
    tiny-code-mtp/      config.json, model.safetensors (MTP head)           -> framework/models/embedded/
    train_log.json      settings, corpus, loss curves, held-out loss, head agreement, wall times, tokens seen
    loss.png            training and held-out loss (and head losses), if matplotlib is installed
    heldout_prompts.json  code prompts cut from held-out files (for training/eval_tiny.py)
and prints on stdout the report rows of docs/embedded-model.md, filled from train_log.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from training.base_model import (  # noqa: E402
    ModelShape,
    TrainSettings,
    build_model,
    count_parameters,
    save_hf_model,
    train_base_model,
)
from training.data import (  # noqa: E402
    EOS_TOKEN,
    collect_corpus,
    encode_stream,
    held_out_prompts,
    save_tokenizer,
    stdlib_root,
    train_tokenizer,
)
from training.heads import HeadSettings, save_head, train_head  # noqa: E402
from training.imports import draft_head_api  # noqa: E402
from training.report import markdown_summary, plot_losses, write_log  # noqa: E402

MODEL_DIR, EAGLE_DIR, MTP_DIR = "tiny-code", "tiny-code-eagle", "tiny-code-mtp"
# Seconds kept back from --total-seconds for saving and the heads' held-out checks (GPU run; smoke run).
RESERVE_SECONDS, SMOKE_RESERVE_SECONDS = 30.0, 4.0

# The smoke configuration: every stage runs, on a few files, with a model small enough for a CPU.
SMOKE_SHAPE = ModelShape(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stdlib", type=Path, default=None, help="source tree to train on (default: this Python's stdlib)")
    p.add_argument("--val-fraction", type=float, default=0.03, help="fraction of files held out (by path hash)")
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (sorted)")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--train-seconds", type=float, default=300.0, help="base-model training budget")
    p.add_argument("--eagle-seconds", type=float, default=70.0, help="EAGLE head training budget (0 = skip)")
    p.add_argument("--mtp-seconds", type=float, default=70.0, help="MTP head training budget (0 = skip)")
    p.add_argument(
        "--total-seconds",
        type=float,
        default=525.0,
        help="hard cap on the whole run: the base-model budget shrinks to fit it",
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--compile", action="store_true", help="torch.compile the base model (GPU)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--smoke", action="store_true", help="CPU check of the whole pipeline: 80 files, a 2-layer model, ~20 s in all"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.max_files = args.max_files or 80
        args.vocab_size = SMOKE_SHAPE.vocab_size
        args.train_seconds, args.eagle_seconds, args.mtp_seconds = 6.0, 3.0, 3.0
        args.total_seconds = min(args.total_seconds, 25.0)
        args.batch_size, args.seq_len = 8, 128
        args.val_fraction = max(args.val_fraction, 0.1)  # a few held-out files even from 80
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.time()
    deadline = start + args.total_seconds
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[train_tiny {time.time() - start:6.1f}s] {msg}", file=sys.stderr, flush=True)

    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    # 1. Corpus and tokenizer.
    root = args.stdlib or stdlib_root()
    corpus = collect_corpus(root, args.val_fraction, args.max_files)
    log(f"corpus {corpus.summary()}")
    tok = train_tokenizer([f.text for f in corpus.train], args.vocab_size)
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id("<|pad|>")
    train_stream, val_stream = encode_stream(tok, corpus.train), encode_stream(tok, corpus.val)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; train {len(train_stream)} tokens, held-out {len(val_stream)}")
    tokenizer_seconds = time.time() - start

    # 2. Base model, for what is left of the budget after the heads.
    shape = SMOKE_SHAPE if args.smoke else dataclasses.replace(ModelShape(), vocab_size=tok.get_vocab_size())
    settings = TrainSettings(
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        peak_lr=args.lr,
        train_seconds=args.train_seconds,
        compile=args.compile,
        eval_every_seconds=max(args.train_seconds / 10, 1.0),
        warmup_steps=20 if args.smoke else 200,
        log_every_steps=5 if args.smoke else 25,
        max_val_windows=16 if args.smoke else 512,
    )
    heads_seconds = args.eagle_seconds + args.mtp_seconds
    left = deadline - time.time() - heads_seconds - (SMOKE_RESERVE_SECONDS if args.smoke else RESERVE_SECONDS)
    if left < settings.train_seconds:
        log(f"--total-seconds leaves {left:.0f}s for the base model (asked {settings.train_seconds:.0f}s)")
        settings = dataclasses.replace(settings, train_seconds=max(left, 1.0))
    model = build_model(shape, eos_id, pad_id, args.seed, device)
    num_params = count_parameters(model)
    log(f"model {shape} with {num_params / 1e6:.2f}M parameters on {device}")
    base = train_base_model(model, train_stream, val_stream, settings, args.seed, device, log)
    log(
        f"base model: {base.steps} steps, {base.tokens_seen / 1e6:.1f}M tokens, best held-out loss "
        f"{base.best_val_loss:.4f} at step {base.best_step}"
    )
    model_dir = out / MODEL_DIR
    save_hf_model(model, model_dir, eos_id, pad_id)  # converts the model to bf16 in place
    save_tokenizer(tok, model_dir, shape.max_position_embeddings)
    target_config = json.loads((model_dir / "config.json").read_text())
    if device.type == "cpu":
        model.float()  # bf16 matmuls are slow on a CPU; the GPU heads train against the bf16 target

    # 3. Draft heads for the frozen model.
    api = draft_head_api()
    heads: dict[str, dict] = {}
    for kind, seconds, sub, kwargs in (
        ("eagle", args.eagle_seconds, EAGLE_DIR, {"fc_bias": True}),
        ("mtp", args.mtp_seconds, MTP_DIR, {}),
    ):
        if seconds <= 0:
            continue
        seconds = min(seconds, max(deadline - time.time() - 15.0, 1.0))
        head_settings = HeadSettings(
            train_seconds=seconds,
            seq_len=min(512, args.seq_len),
            batch_size=args.batch_size,
            warmup_steps=5 if args.smoke else 50,
            log_every_steps=5 if args.smoke else 25,
            max_val_windows=4 if args.smoke else 64,
        )
        head, result = train_head(
            api[kind],
            kind,
            model,
            target_config,
            api["head_config"],
            train_stream,
            val_stream,
            head_settings,
            args.seed,
            device,
            log,
            head_kwargs=kwargs,
        )
        save_head(head, out / sub)
        api["load_draft_head"](out / sub, kind, target_config)  # what the speculator will do: must load strictly
        heads[kind] = {**result.as_dict(), "settings": dataclasses.asdict(head_settings), "dir": sub}

    # 4. Prompts for the evaluation, the log and the plot.
    prompts = held_out_prompts(corpus.val, num=32, prompt_chars=400, seed=args.seed)
    (out / "heldout_prompts.json").write_text(json.dumps(prompts, indent=1) + "\n")
    train_log = {
        "seed": args.seed,
        "smoke": args.smoke,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "corpus": {
            **corpus.summary(),
            "train_tokens": int(len(train_stream)),
            "val_tokens": int(len(val_stream)),
            "val_fraction": args.val_fraction,
        },
        "tokenizer": {
            "vocab_size": tok.get_vocab_size(),
            "eos_token_id": eos_id,
            "pad_token_id": pad_id,
            "seconds": round(tokenizer_seconds, 2),
        },
        "model": {
            **dataclasses.asdict(shape),
            "parameters": num_params,
            "weights_bytes": (model_dir / "model.safetensors").stat().st_size,
        },
        "base_settings": dataclasses.asdict(settings),
        "base_model": base.as_dict(),
        "heads": heads,
        "wall_seconds": round(time.time() - start, 2),
    }
    write_log(out / "train_log.json", train_log)
    plot_losses(out / "loss.png", train_log, log)
    log(f"done in {train_log['wall_seconds']:.0f}s: held-out loss {base.best_val_loss:.4f}; wrote {out}")
    print(markdown_summary(train_log))  # the report rows of docs/embedded-model.md
    return 0


if __name__ == "__main__":
    sys.exit(main())
