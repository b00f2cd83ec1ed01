"""The grammar library behind structured outputs: llguidance, the only one (there is no setting).

It compiles a request's `StructuredOutputsParams` into a grammar over the model's token vocabulary and makes
one matcher per request. Compiled grammars are cached by their text, so a thousand requests with one schema
compile it once. The token vocabulary is built on first use (about a second for a 150K-token tokenizer).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, Iterator, Optional

import llguidance
import numpy as np

from framework.params.request_errors import InvalidRequestError
from framework.params.structured_outputs import StructuredOutputsParams

GRAMMAR_CACHE_SIZE = 1024  # distinct grammars kept compiled (least recently used dropped first)
WHERE = "SamplingParams.structured_outputs"
# llguidance's JSON options per `StructuredOutputsParams.whitespace`: "one" is at most one space between tokens.
JSON_WHITESPACE: dict[str, dict[str, Any]] = {
    "none": {"whitespace_flexible": False},
    "one": {"whitespace_flexible": False, "whitespace_pattern": " ?"},
    "any": {"whitespace_flexible": True},
}


class _ByteVocabulary:
    """The byte tokenizer as llguidance sees it: ids 0-255 are bytes, every id from 256 up is special."""

    bos_token_id = None

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.eos_token_id = eos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|special_{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


class GuidanceBackend:
    """llguidance over one model's vocabulary: `check` (validate and cache) and `new_matcher`."""

    name = "guidance"

    def __init__(self, tokenizer: Optional[object], vocab_size: int, eos_token_id: Optional[int]) -> None:
        """`tokenizer`: any of the engine's tokenizers (`framework.models.tokenizer`), told apart by what they offer."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lltokenizer: Optional[llguidance.LLTokenizer] = None
        self._grammars: OrderedDict[tuple, str] = OrderedDict()
        self.num_compiled = 0  # grammars compiled (cache misses), for tests and stats

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            self._lltokenizer = self._build_tokenizer()
        return self._lltokenizer

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        tok, eos = self._tokenizer, self.eos_token_id
        if eos is None:
            raise InvalidRequestError(
                f"{WHERE} needs the model's end-of-sequence token, and this model has none "
                "(a grammar ends by sampling it)"
            )
        # Told apart by what they offer: framework.models.tokenizer sits above the samplers (it imports the models).
        if getattr(tok, "byte_level", False):
            return llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_ByteVocabulary(self.vocab_size, eos)), n_vocab=self.vocab_size
            )
        if hasattr(tok, "to_json"):  # HFTokenizer: its tokenizer.json
            return llguidance.LLTokenizer(tok.to_json(), n_vocab=self.vocab_size, eos_token=eos)  # type: ignore[union-attr]
        raise InvalidRequestError(
            f"{WHERE} needs the model's tokenizer (tokenizer.json); this model has "
            f"{'none' if tok is None else type(tok).__name__}"
        )

    def check(self, params: StructuredOutputsParams) -> str:
        """The compiled grammar (cached); raises `InvalidRequestError` naming a malformed schema, regex or grammar."""
        key = params.cache_key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        grammar = self._compile(params)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise InvalidRequestError(f"{WHERE}.{params.kind} is invalid: {_first_lines(error)}")
        self.num_compiled += 1
        self._grammars[key] = grammar
        if len(self._grammars) > GRAMMAR_CACHE_SIZE:
            self._grammars.popitem(last=False)
        return grammar

    def new_matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar."""
        matcher = llguidance.LLMatcher(self.lltokenizer, self.check(params), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{WHERE}.{params.kind} is invalid: {_first_lines(matcher.get_error())}")
        return matcher

    def can_run_for(self, params: StructuredOutputsParams, num_tokens: int, max_steps: int = 2000) -> Optional[bool]:
        """Whether the grammar admits `num_tokens` tokens before its end (end of sequence): True when a depth-first
        walk over the allowed tokens finds such a path, False when the walk saw every path end sooner, None when it
        gave up after `max_steps` tokens tried (undecided). A grammar that must end sooner cannot meet a request's
        min_tokens, which forbids end of sequence until then."""
        matcher = self.new_matcher(params)

        def allowed() -> Iterator[int]:
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            return (int(t) for t in np.flatnonzero(bits[: self.vocab_size]) if t != self.eos_token_id)

        stack = [allowed()]
        steps = 0
        while stack:
            if len(stack) - 1 >= num_tokens:
                return True
            token = next(stack[-1], None)
            if token is None:
                stack.pop()
                if stack:
                    matcher.rollback(1)
                continue
            steps += 1
            if steps > max_steps:
                return None
            if matcher.consume_token(token):
                stack.append(allowed())
        return False

    @staticmethod
    def _compile(params: StructuredOutputsParams) -> str:
        kind = params.kind
        if kind in ("json", "json_object"):
            schema: Any = params.json if kind == "json" else {"type": "object"}
            options = JSON_WHITESPACE[params.whitespace]
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)  # type: ignore[arg-type]
            except (ValueError, TypeError) as err:
                raise InvalidRequestError(f"{WHERE}.json is invalid: {_first_lines(str(err))}") from None
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(params.regex or "")
        if kind == "choice":
            # JSON string literals are Lark string literals: any character of a choice is matched as itself.
            alternatives = " | ".join(json.dumps(c) for c in params.choice or [])
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        return llguidance.LLMatcher.grammar_from_lark(params.grammar or "")


def _first_lines(message: str, limit: int = 4) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines()[:limit] if line.strip())
