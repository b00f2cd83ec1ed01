"""The o200k vocabulary that openai-harmony encodes with, found without the network.

openai-harmony reads `o200k_base.tiktoken` from the directory named by `TIKTOKEN_ENCODINGS_BASE`, else downloads it
from OpenAI's public blob store (checking its SHA-256 either way). mrv2 never lets it download: `load_encoding`
always names a directory. Where the user already set `TIKTOKEN_ENCODINGS_BASE`, that one; otherwise the file is
written from the checkpoint's own `tokenizer.json` (gpt-oss ships o200k_harmony: o200k_base's 199,998 byte-level
BPE tokens, then harmony's special tokens) into a temporary directory that is removed once the encoding is loaded.
The written file must hash to o200k_base's published SHA-256, so a checkpoint with another vocabulary is refused
by name rather than mis-encoded.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

from framework.params.request_errors import InvalidRequestError

ENV = "TIKTOKEN_ENCODINGS_BASE"
VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"  # o200k_base, as harmony checks it
NUM_BPE_TOKENS = 199_998  # ranks 0..199997; the ids above are special tokens
_ENV_LOCK = threading.Lock()  # the variable is process-wide: one load at a time sets and restores it


class HarmonyUnavailable(InvalidRequestError):
    """The harmony format cannot be used: openai-harmony or the o200k vocabulary is missing."""


def _bytes_of_unicode() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character -> the byte it stands for (GPT-2's table, which HF
    `tokenizers`' ByteLevel pre-tokenizer writes vocabularies in)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


def vocab_from_tokenizer_json(path: Path) -> bytes:
    """The `o200k_base.tiktoken` text (`base64(token bytes) rank` per line, by rank) of a byte-level BPE
    tokenizer.json; raises `HarmonyUnavailable` when it is not o200k's (its SHA-256 differs)."""
    try:
        model: Any = json.loads(path.read_text(encoding="utf-8")).get("model", {})
        vocab = model.get("vocab") if isinstance(model, dict) else None
        table = _bytes_of_unicode()
        ranked = sorted((rank, token) for token, rank in (vocab or {}).items() if rank < NUM_BPE_TOKENS)
        text = b"".join(base64.b64encode(bytes(table[c] for c in token)) + b" %d\n" % rank for rank, token in ranked)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise HarmonyUnavailable(f"{path} is not a byte-level BPE tokenizer.json ({err})") from None
    if hashlib.sha256(text).hexdigest() != VOCAB_SHA256:
        raise HarmonyUnavailable(
            f"{path} does not hold o200k_base's {NUM_BPE_TOKENS} tokens (gpt-oss's vocabulary), which the harmony "
            f"chat format needs; set {ENV} to a directory with {VOCAB_FILE}, or serve.chat_format=template"
        )
    return text


def _load_from(directory: str) -> Any:
    from openai_harmony import HarmonyEncodingName, HarmonyError, load_harmony_encoding

    with _ENV_LOCK:
        before = os.environ.get(ENV)
        os.environ[ENV] = directory
        try:
            return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
        except HarmonyError as err:
            raise HarmonyUnavailable(f"openai-harmony could not load {Path(directory) / VOCAB_FILE}: {err}") from None
        finally:
            if before is None:
                del os.environ[ENV]
            else:
                os.environ[ENV] = before


@functools.lru_cache(maxsize=4)
def load_encoding(model_dir: Optional[str]) -> Any:
    """openai-harmony's gpt-oss encoding (`HarmonyEncoding`), its vocabulary from `TIKTOKEN_ENCODINGS_BASE` when
    set, else from the checkpoint at `model_dir`; never from the network. Raises `HarmonyUnavailable`."""
    try:
        import openai_harmony  # noqa: F401
    except ImportError:
        raise HarmonyUnavailable("the harmony chat format needs the openai-harmony package") from None
    if os.environ.get(ENV):
        return _load_from(os.environ[ENV])
    tokenizer_json = Path(model_dir) / "tokenizer.json" if model_dir else None
    if tokenizer_json is None or not tokenizer_json.is_file():
        raise HarmonyUnavailable(
            f"the harmony chat format needs the o200k vocabulary: this model has no tokenizer.json to take it from; "
            f"set {ENV} to a directory with {VOCAB_FILE}, or serve.chat_format=template"
        )
    text = vocab_from_tokenizer_json(tokenizer_json)
    with tempfile.TemporaryDirectory(prefix="mrv2-harmony-") as directory:
        (Path(directory) / VOCAB_FILE).write_bytes(text)
        return _load_from(directory)
