"""Training data for the tiny code model: the Python standard library's own .py sources on this machine.

Files are split into training and held-out sets by a hash of their path relative to the stdlib root, so
the split does not depend on which other files exist or on the order a directory lists them in. The
tokenizer is a byte-level BPE trained on the training files only; documents are joined into one token
stream with `<|endoftext|>` between them.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

EOS_TOKEN = "<|endoftext|>"
# Reserved for later use (fill-in-the-middle, padding); keeping them from the start fixes their ids.
SPECIAL_TOKENS = [EOS_TOKEN, "<|pad|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]
# Third-party packages live under the stdlib path on most installs; they are not the standard library.
EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 1 << 20  # a few generated tables in the stdlib are huge and teach nothing about code


@dataclass(frozen=True)
class SourceFile:
    """One .py file: its path relative to the stdlib root (the split key) and its text."""

    rel_path: str
    text: str


@dataclass(frozen=True)
class Corpus:
    """The training and held-out files, disjoint by file."""

    root: str
    train: list[SourceFile]
    val: list[SourceFile]

    def summary(self) -> dict[str, object]:
        return {
            "stdlib_root": self.root,
            "train_files": len(self.train),
            "val_files": len(self.val),
            "train_chars": sum(len(f.text) for f in self.train),
            "val_chars": sum(len(f.text) for f in self.val),
        }


def stdlib_root() -> Path:
    """Where this interpreter's standard library sources are."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(rel_path: str, val_fraction: float) -> bool:
    """Deterministic per-file split: a stable hash of the relative path, not Python's salted `hash`."""
    bucket = int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest()[:8], 16) % 10_000
    return bucket < round(val_fraction * 10_000)


def collect_corpus(root: Path, val_fraction: float, max_files: Optional[int] = None) -> Corpus:
    """Read every UTF-8 .py file under `root` (sorted), skipping third-party packages and huge files.

    `max_files` keeps the first N files of the sorted list (smoke runs); the split is unchanged by it.
    """
    train: list[SourceFile] = []
    val: list[SourceFile] = []
    paths = sorted(p for p in root.rglob("*.py") if not EXCLUDED_PARTS.intersection(p.relative_to(root).parts))
    if max_files is not None:
        paths = paths[:max_files]
    for path in paths:
        try:
            if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_bytes().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # test fixtures in other encodings, broken links: not training material
        if not text.strip():
            continue
        rel = path.relative_to(root).as_posix()
        (val if is_held_out(rel, val_fraction) else train).append(SourceFile(rel, text))
    if not train or not val:
        raise RuntimeError(f"{root}: found {len(train)} training and {len(val)} held-out .py files; need both")
    return Corpus(root=str(root), train=train, val=val)


def train_tokenizer(texts: Sequence[str], vocab_size: int):  # type: ignore[no-untyped-def]
    """A byte-level BPE (`tokenizers.Tokenizer`) trained on `texts`; the special tokens take ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: code starts at column 0, and a prompt must tokenize as it would inside a file.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte is a token: nothing is unknown
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok, out_dir: Path, model_max_length: int) -> None:  # type: ignore[no-untyped-def]
    """tokenizer.json plus the tokenizer_config.json that transformers' AutoTokenizer reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|pad|>",
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"eos_token": EOS_TOKEN, "pad_token": "<|pad|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def encode_stream(tok, files: Sequence[SourceFile]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """[N] int32: every file's tokens followed by `<|endoftext|>`, in file order."""
    eos = tok.token_to_id(EOS_TOKEN)
    encodings = tok.encode_batch([f.text for f in files], add_special_tokens=False)
    pieces = []
    for enc in encodings:
        pieces.append(np.asarray(enc.ids, dtype=np.int32))
        pieces.append(np.asarray([eos], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def held_out_prompts(files: Sequence[SourceFile], num: int, prompt_chars: int, seed: int) -> list[str]:
    """`num` code prompts cut from held-out files at line starts (for evaluating the model and speculators).

    Each prompt is `prompt_chars` characters ending at a line break, taken from a random line of a random
    held-out file; seeded, so the same files give the same prompts.
    """
    rng = np.random.default_rng(seed)
    usable = [f for f in files if len(f.text) > 2 * prompt_chars]
    if not usable:
        raise RuntimeError("no held-out file is long enough to cut prompts from")
    prompts: list[str] = []
    for _ in range(num * 4):
        if len(prompts) == num:
            break
        text = usable[int(rng.integers(len(usable)))].text
        end = text.find("\n", int(rng.integers(prompt_chars, len(text) - prompt_chars)))
        if end < 0:
            continue
        prompt = text[max(0, end + 1 - prompt_chars) : end + 1]
        start = prompt.find("\n") + 1  # start at a line start too
        if 0 < start < len(prompt) // 2:
            prompt = prompt[start:]
        if prompt.strip():
            prompts.append(prompt)
    return prompts
