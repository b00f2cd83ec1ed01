"""The API server's text of one sequence: token-id deltas from the engine -> text deltas, with stop strings.

The engine core streams tokens only. Here they are detokenized as the offline `OutputProcessor` does it (the
same `IncrementalDetokenizer`, the same stop-string search), so a served greedy completion has the offline
text. A stop string ends the sequence here; the caller then aborts it in the engine.
"""

from __future__ import annotations

from typing import Any, Optional

from framework.engine.detokenizer import make_detokenizer, stop_string_hit, untold_stop_tokens
from framework.entrypoints.serve.protocol import TokenLogprobs
from framework.params.sampling_params import SamplingParams


class SequenceText:
    """Tokens, logprobs and text of one sequence so far; `release()` gives the text a stream may show now."""

    def __init__(self, tokenizer: Any, params: SamplingParams, incremental: bool) -> None:
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprobs]] = [] if params.logprobs is not None else None
        self.stop_string: Optional[str] = None
        self._detok = make_detokenizer(tokenizer, params.skip_special_tokens) if tokenizer is not None else None
        # Streams and stop strings need text as tokens come; otherwise the output is decoded once at its end.
        self._incremental = incremental or bool(params.stop)
        self._released = 0  # characters a stream has shown
        self._untold = 0  # 1 when a stop token ended the sequence and its text stays out (`untold_stop_tokens`)
        self._holdback = max((len(s) for s in params.stop or []), default=1) - 1  # a stop string may be growing
        if params.include_stop_str_in_output:
            self._holdback = 0

    @property
    def text(self) -> str:
        return self._detok.text if self._detok is not None else ""

    def add(
        self, token_ids: list[int], logprobs: Optional[list[TokenLogprobs]], stopped_by_token: bool = False
    ) -> bool:
        """Append one delta; True when a stop string ended the sequence (tokens after it are dropped).
        `stopped_by_token`: the delta's last token (eos or a `stop_token_ids` entry) ended the sequence in the
        engine; its text is left out unless `include_stop_str_in_output`, as the offline OutputProcessor does."""
        # The engine's final delta carries the stop (nothing follows it): `finish` reads this after it.
        self._untold = untold_stop_tokens(stopped_by_token, self.params.include_stop_str_in_output)
        if self.logprobs is None and not self.params.stop and not self._untold:  # most deltas: only text to make
            self.token_ids.extend(token_ids)
            if self._detok is not None and self._incremental:
                append = self._detok.append
                for token in token_ids:
                    append(token)
            return False
        for i, token in enumerate(token_ids):
            self.token_ids.append(token)
            if self.logprobs is not None and logprobs is not None and i < len(logprobs):
                self.logprobs.append(logprobs[i])
            if self._detok is None or not self._incremental or i >= len(token_ids) - self._untold:
                continue
            delta = self._detok.append(token)
            hit = stop_string_hit(
                self._detok.text, self.params.stop or [], len(delta), len(self.token_ids), self.params.min_tokens
            )
            if hit is not None:
                stop, index = hit
                keep = index + len(stop) if self.params.include_stop_str_in_output else index
                self._detok.text = self._detok.text[:keep]
                self.stop_string = stop
                return True
        return False

    def finish(self) -> None:
        """The sequence ended in the engine: release what the detokenizer held back (or decode it once)."""
        if self._detok is None or self.stop_string is not None:
            return
        if self._incremental:
            self._detok.flush()
        else:
            self._detok.decode_all(self.token_ids[: len(self.token_ids) - self._untold])

    def release(self, final: bool) -> str:
        """The text not yet shown (while running: minus a tail that may be the start of a stop string)."""
        text = self.text
        end = len(text) if final or not self.params.stop else max(self._released, len(text) - self._holdback)
        delta, self._released = text[self._released : end], end
        return delta
