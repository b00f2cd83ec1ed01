"""Incremental detokenization and stop strings, on the host.

Decoding token by token is wrong for most tokenizers (a UTF-8 character or a word can span tokens, and
tokenizers drop or add spaces at the start of a decode), so each new token is decoded inside a short window
of the tokens before it, and text is released only once it no longer ends in an incomplete character.
"""

from __future__ import annotations

import codecs
import inspect
from typing import Any, Callable, Optional, Sequence, Union

REPLACEMENT_CHAR = "\ufffd"


def make_decode(tokenizer: Any, skip_special_tokens: bool):  # type: ignore[no-untyped-def]
    """`decode(ids) -> str`, passing `skip_special_tokens` when the tokenizer's decode accepts it."""
    try:
        accepts = "skip_special_tokens" in inspect.signature(tokenizer.decode).parameters
    except (TypeError, ValueError):
        accepts = False
    if accepts:
        return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode


class IncrementalDetokenizer:
    """Turns output tokens into text one token at a time; `text` is everything released so far.

    The text matches `tokenizer.decode(output_token_ids)` (the output is decoded on its own, as the engine
    always did, not as a continuation of the prompt).
    """

    def __init__(
        self, tokenizer: Any, skip_special_tokens: bool = True, decode: Optional[Callable[[Sequence[int]], str]] = None
    ) -> None:
        """`decode`: `make_decode(tokenizer, skip_special_tokens)` made once for many requests (it inspects the
        tokenizer's signature, the dearest part of a new detokenizer); made here if not given."""
        self._decode = decode if decode is not None else make_decode(tokenizer, skip_special_tokens)
        self._tokens: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens before this are already in `text`
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it released (possibly empty)."""
        self._tokens.append(token_id)
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT_CHAR):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of the request: release what is held back (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self._tokens[self._prefix_offset :])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Replace everything with one decode of the whole output (requests that never need partial text)."""
        self._tokens = list(token_ids)
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text = self._decode(self._tokens)
        return self.text

    def decode_one(self, token_id: int) -> str:
        """The text of a single token (for logprob entries)."""
        return self._decode([token_id])


class ByteStreamDetokenizer:
    """`IncrementalDetokenizer` for a byte-level tokenizer (`tokenizer.byte_level`: token id = byte value, ids from
    256 up have no text): one incremental UTF-8 decode per token instead of two window decodes. The released text
    is the same (`decode(output_token_ids)` once flushed); an incomplete character is held back until it
    completes, an invalid byte shows as U+FFFD at once."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._tokens: list[int] = []
        self.text = ""

    def append(self, token_id: int) -> str:
        """Add one token; returns the text it released (possibly empty)."""
        self._tokens.append(token_id)
        if not 0 <= token_id < 256:
            return ""
        delta = self._utf8.decode(bytes((token_id,)))
        if delta:
            self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the request: an incomplete character at the end decodes as U+FFFD."""
        delta = self._utf8.decode(b"", final=True)
        self.text += delta
        return delta

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Replace everything with one decode of the whole output."""
        self._tokens = list(token_ids)
        self._utf8.reset()
        self.text = bytes(t for t in self._tokens if 0 <= t < 256).decode("utf-8", errors="replace")
        return self.text

    def decode_one(self, token_id: int) -> str:
        return bytes((token_id,)).decode("utf-8", errors="replace") if 0 <= token_id < 256 else ""


Detokenizer = Union[IncrementalDetokenizer, ByteStreamDetokenizer]


def make_detokenizer(tokenizer: Any, skip_special_tokens: bool = True) -> Detokenizer:
    """The cheapest detokenizer that gives `tokenizer.decode`'s text: the byte stream for byte-level
    tokenizers, else the windowed `IncrementalDetokenizer`."""
    if getattr(tokenizer, "byte_level", False):
        return ByteStreamDetokenizer()
    return IncrementalDetokenizer(tokenizer, skip_special_tokens)


def find_stop_string(text: str, stops: Sequence[str], num_new_chars: int) -> Optional[tuple[str, int]]:
    """(stop string, index) of the earliest stop string that overlaps the last `num_new_chars` characters.

    Only matches that end in the new text count, so a stop string is found on the step that completes it.
    Among matches at the same index the first in `stops` wins.
    """
    best: Optional[tuple[str, int]] = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index >= 0 and (best is None or index < best[1]):
            best = (stop, index)
    return best


def stop_string_hit(
    text: str, stops: Sequence[str], num_new_chars: int, num_output: int, min_tokens: int
) -> Optional[tuple[str, int]]:
    """`find_stop_string` once `min_tokens` output tokens are out: the token that completes a stop string counts,
    so a stop string completed by exactly the `min_tokens`-th token ends the sequence there (vLLM's rule).

    `num_output` counts the output tokens up to and including the one whose text ends `text`. The offline
    OutputProcessor and the API server's SequenceText both decide through this one function.
    """
    if not stops or num_new_chars == 0 or num_output < min_tokens:
        return None
    return find_stop_string(text, stops, num_new_chars)


def untold_stop_tokens(stopped_by_token: bool, include_stop_str_in_output: bool) -> int:
    """How many of a step's last tokens get no text: 1 when a stop token (eos or a `stop_token_ids` entry) ended
    the sequence and `include_stop_str_in_output` is off (vLLM's rule; the token stays in the ids), else 0. The
    offline OutputProcessor and the API server's SequenceText both apply it."""
    return 1 if stopped_by_token and not include_stop_str_in_output else 0
