"""openai-harmony's o200k vocabulary found offline: written from a gpt-oss checkpoint's tokenizer.json (as
transformers' TikTokenConverter writes it), checked against o200k's published SHA-256, loaded without any download
(a proxy that refuses every connection and an empty download cache prove it); a checkpoint with another vocabulary,
or none, is refused by name."""

from __future__ import annotations

import base64
import json
import lzma
from pathlib import Path
from typing import Any

import pytest
from helpers.harmony_models import VOCAB_XZ, harmony_encoding, write_tokenizer, write_vocab

from framework.entrypoints.harmony.chat import uses_harmony
from framework.entrypoints.harmony.vocab import ENV, HarmonyUnavailable, load_encoding, vocab_from_tokenizer_json

TEXTS = ["Hello, world!", "  café ☕ naïve — 東京 1234567 don't\n\n\tx", "<|start|>assistant<|channel|>final"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    vocab = write_vocab(tmp_path_factory.mktemp("o200k"))
    out = tmp_path_factory.mktemp("gpt-oss-tokenizer")
    write_tokenizer(vocab, out)
    return out


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No vocabulary directory set, a proxy that refuses connections, an empty download cache (returned)."""
    cache = tmp_path / "tiktoken-rs-cache"
    cache.mkdir()
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setenv("TIKTOKEN_RS_CACHE_DIR", str(cache))
    for proxy in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(proxy, "http://127.0.0.1:9")  # the discard port: nothing listens
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    load_encoding.cache_clear()
    return cache


def test_the_encoding_loads_from_the_checkpoint_without_the_network(checkpoint: Path, offline: Path):
    """The file written from the checkpoint passes o200k's SHA-256 (checked here and by openai-harmony)."""
    encoding = load_encoding(str(checkpoint))
    assert offline.is_dir() and not any(offline.iterdir())  # nothing was downloaded into the cache
    import os

    assert ENV not in os.environ  # set only while loading
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    for text in TEXTS:  # the checkpoint's tokenizer and openai-harmony agree token for token
        assert hf.encode(text, add_special_tokens=False).ids == encoding.encode(text, allowed_special="all")
    assert sorted(encoding.stop_tokens_for_assistant_actions()) == [200002, 200012]


def test_harmony_without_any_vocabulary_fails_offline(offline: Path):
    """The control for the offline proof: openai-harmony left alone would download, and the proxy refuses it."""
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    with pytest.raises(HarmonyError):
        load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def test_a_directory_the_user_names_is_used(tmp_path: Path, offline: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(ENV, str(write_vocab(tmp_path / "mine")))
    assert load_encoding(None).encode("Hello", allowed_special="all") == [13225]


def test_another_vocabulary_is_refused_by_name(tmp_path: Path, offline: Path):
    lines = lzma.decompress(VOCAB_XZ.read_bytes()).splitlines()
    table = {chr(b): b for b in range(ord("!"), ord("~") + 1)}  # printable ASCII stands for itself
    vocab = {}
    for rank, line in enumerate(lines[:5000]):  # o200k's first tokens, all but one of them ASCII-printable
        token = base64.b64decode(line.split()[0])
        if all(chr(b) in table for b in token):
            vocab[token.decode()] = rank
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}}))
    with pytest.raises(HarmonyUnavailable, match="o200k_base"):
        load_encoding(str(tmp_path))
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(HarmonyUnavailable, match="not a byte-level BPE tokenizer.json"):
        vocab_from_tokenizer_json(tmp_path / "tokenizer.json")


def test_a_checkpoint_without_tokenizer_is_refused_by_name(tmp_path: Path, offline: Path):
    with pytest.raises(HarmonyUnavailable, match="no tokenizer.json.*TIKTOKEN_ENCODINGS_BASE"):
        load_encoding(str(tmp_path))


@pytest.mark.parametrize(
    "chat_format, architectures, expected",
    [
        ("auto", ["GptOssForCausalLM"], True),
        ("auto", ["Qwen3ForCausalLM"], False),
        ("auto", None, False),
        ("template", ["GptOssForCausalLM"], False),
        ("harmony", ["LlamaForCausalLM"], True),
    ],
)
def test_which_models_chat_in_harmony(chat_format: str, architectures: Any, expected: bool):
    assert uses_harmony(chat_format, {"architectures": architectures}) is expected


def test_the_vendored_vocabulary_is_harmonys(tmp_path: Path):
    assert harmony_encoding(write_vocab(tmp_path)).encode("Hello world", allowed_special="all") == [13225, 2375]
