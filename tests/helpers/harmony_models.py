"""gpt-oss's vocabulary and a tiny random gpt-oss chat checkpoint for the harmony tests, without the network.

`tests/data/o200k_base.tiktoken.xz` is o200k_base.tiktoken (tiktoken's published vocabulary, MIT; SHA-256
446a9538..., the hash openai-harmony checks), rebuilt from the ranks the npm package js-tiktoken 1.0.21 ships and
compressed. The checkpoint's tokenizer.json is written from it by transformers' own `TikTokenConverter` (as
transformers converts gpt-oss's vocabulary), with harmony's special tokens at their ids, so it is gpt-oss's
tokenizer as far as the tests can tell (`test_harmony_vocab` checks it encodes as openai-harmony does).
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path
from typing import Any

VOCAB_XZ = Path(__file__).resolve().parents[1] / "data" / "o200k_base.tiktoken.xz"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SIZE = 201_088  # gpt-oss's: o200k_base's 199,998 tokens, then harmony's special and reserved tokens
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
SPECIAL_NAMES = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
}


def write_vocab(directory: Path) -> Path:
    """o200k_base.tiktoken in `directory` (for `TIKTOKEN_ENCODINGS_BASE`); returns the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / VOCAB_FILE).write_bytes(lzma.decompress(VOCAB_XZ.read_bytes()))
    return directory


def harmony_encoding(vocab_dir: Path) -> Any:
    """openai-harmony's gpt-oss encoding, read from `vocab_dir` (never downloaded)."""
    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(vocab_dir)
    try:
        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if before is None:
            del os.environ["TIKTOKEN_ENCODINGS_BASE"]
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = before


def write_tokenizer(vocab_dir: Path, out: Path) -> None:
    """gpt-oss's tokenizer.json (o200k_harmony) in `out`, written by transformers' TikTokenConverter."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    specials = [SPECIAL_NAMES.get(i, f"<|reserved_{i}|>") for i in range(199_998, VOCAB_SIZE)]
    converter = TikTokenConverter(str(vocab_dir / VOCAB_FILE), pattern=O200K_PATTERN, extra_special_tokens=specials)
    out.mkdir(parents=True, exist_ok=True)
    converter.converted().save(str(out / "tokenizer.json"))


def write_chat_checkpoint(vocab_dir: Path, out: Path) -> None:
    """A tiny random `GptOssForCausalLM` with gpt-oss's vocabulary and tokenizer (no chat template: harmony
    renders), stopping on `<|return|>`, `<|endoftext|>` and `<|call|>` as gpt-oss's generation config says."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        initializer_range=0.2,
        eos_token_id=200002,
        pad_token_id=199999,
    )
    torch.manual_seed(0)
    GptOssForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [200002, 199999, 200012]}))
    write_tokenizer(vocab_dir, out)
