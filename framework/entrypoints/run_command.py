"""`mrv2 run`: complete the configured prompts and print them, nothing else, on stdout."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

import torch

from framework.config.schema import Mrv2Config
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams


def printable(text: str) -> str:
    """Escape control characters (random-weight models emit them) so the terminal shows what came out."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode() for c in text)


def sampling_params_from_config(config: Mrv2Config) -> SamplingParams:
    s = config.sampler
    return SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        min_p=s.min_p,
        seed=s.seed,
        max_tokens=s.max_tokens,
        ignore_eos=s.ignore_eos,
    )


def format_embedding(index: int, embedding: list[float], num_values: int = 4) -> str:
    """One deterministic line per embedding: its index, dimension, L2 norm and first values."""
    norm = sum(v * v for v in embedding) ** 0.5
    head = " ".join(f"{v:+.4f}" for v in embedding[:num_values])
    return f"embedding {index}: dim={len(embedding)} norm={norm:.4f} [{head} ...]"


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (its own default unless TRITON_CACHE_DIR says otherwise)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def first_compile_notice(on_cuda: bool, cache_dir: Path) -> Optional[str]:
    """A stderr line for a first run on a GPU: Triton compiles every kernel once (tens of seconds, with the
    progress bar still at 0%), then loads them from `cache_dir`. None on a CPU or with kernels already cached."""
    if not on_cuda or (cache_dir.is_dir() and any(cache_dir.iterdir())):
        return None
    return (
        "mrv2: first run on this machine: compiling the Triton kernels for this GPU (about half a minute, once; "
        f"cached in {cache_dir})"
    )


def run_command(config: Mrv2Config) -> list[str]:
    """Generate for `config.run.prompts` and print one block per prompt (`task=embed`: one line per prompt).

    Returns what went wrong with the requests that ended in an error ("completion 1: ..."), so that the
    command can exit nonzero; empty when every request finished.
    """
    notice = first_compile_notice(config.device != "cpu" and torch.cuda.is_available(), triton_cache_dir())
    if notice is not None:
        print(notice, file=sys.stderr, flush=True)
    llm = LLM(config=config)
    if config.task == "embed":
        pooled = llm.encode(config.run.prompts, use_tqdm=config.run.show_progress)
        for i, out in enumerate(pooled):
            print(format_embedding(i, out.embedding))
        return [f"embedding {i}: {out.error}" for i, out in enumerate(pooled) if out.finish_reason == "error"]
    outputs = llm.generate(config.run.prompts, sampling_params_from_config(config), use_tqdm=config.run.show_progress)
    for i, out in enumerate(outputs):
        print(f"--- completion {i} ({out.finish_reason}, {len(out.token_ids)} tokens) ---")
        print(printable((out.prompt or "") + out.text))
    return [f"completion {i}: {out.error}" for i, out in enumerate(outputs) if out.finish_reason == "error"]
