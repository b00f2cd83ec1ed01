"""Tokenizers: HF `tokenizers` from a checkpoint's tokenizer.json, or bytes for the embedded presets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Protocol

from framework.models.presets import BYTE_EOS_ID


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_id: Optional[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; 256 is end of text; ids above 256 decode to nothing."""

    eos_token_id: Optional[int] = BYTE_EOS_ID
    byte_level = True  # token id = byte value (how the grammar backend builds its vocabulary)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Bytes to text; ids above 255 (end of text, unused ids) have no text either way."""
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A checkpoint's tokenizer.json through HF `tokenizers` (no remote code, no network)."""

    def __init__(self, path: Path, eos_token_id: Optional[int]) -> None:
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(path / "tokenizer.json"))
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        """The tokenizer.json text (padding and truncation off), for libraries that rebuild the tokenizer."""
        from tokenizers import Tokenizer as _Tok

        copy = _Tok.from_str(self._tok.to_str())
        copy.no_padding()
        copy.no_truncation()
        return copy.to_str()


def eos_ids_of(value: Any) -> tuple[int, ...]:
    """A config's `eos_token_id` (an id, a list of ids, or None) as a tuple of ids."""
    return tuple(int(e) for e in (value if isinstance(value, list) else [value]) if e is not None)


def checkpoint_eos_token_ids(path: Path, hf_config: dict) -> tuple[int, ...]:
    """Every end-of-sequence id, generation_config.json's first, else config.json's: one id, or a list (Llama 3.x
    Instruct lists <|end_of_text|>, <|eom_id|> and <|eot_id|>; HF's generate stops at any of them)."""
    for source in (path / "generation_config.json", None):
        cfg = json.loads(source.read_text()) if source is not None and source.is_file() else hf_config
        ids = eos_ids_of(cfg.get("eos_token_id"))
        if ids:
            return ids
    return ()


def checkpoint_eos_token_id(path: Path, hf_config: dict) -> Optional[int]:
    """The primary end-of-sequence id: the first of `checkpoint_eos_token_ids`."""
    ids = checkpoint_eos_token_ids(path, hf_config)
    return ids[0] if ids else None


def load_tokenizer(path: Optional[str], hf_config: dict) -> Optional[Tokenizer]:
    """The tokenizer for a model: HF directory's tokenizer.json, bytes for presets, None if absent."""
    if path is None:
        return ByteTokenizer()
    root = Path(path)
    if not (root / "tokenizer.json").is_file():
        return None
    return HFTokenizer(root, checkpoint_eos_token_id(root, hf_config))
