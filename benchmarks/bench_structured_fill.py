"""Host cost of filling the grammar bitmasks of one step, without a model (runs on any CPU).

128 matchers of `SCHEMA` (also the nano bench's) (every other row of the nano bench's batch of 256) walk a JSON text,
each from its own offset, so a step mixes positions inside strings and numbers (dear masks) with structural
ones (cheap). Per step it times the host from the start of the fill to the last mask written, for:

- `llguidance LLExecutor`: llguidance's one-call parallel fill (rayon pool, its default size), as mrv2 did before;
- `filler, N threads`: `samplers.structured.fill.BitmaskFiller` (N worker threads plus the joining thread), the
  workers forced to fill every step;
- `filler, adaptive`: the same with the most threads, as the engine runs it (workers only for dear masks).

Vocabularies: `nano` = the byte tokenizer padded to Qwen3's 151,936 ids (the nano bench); `synthetic` = 151,936
tokens (the 256 bytes plus random printable strings of 2-8 characters), closer to a real tokenizer: masks inside
strings cost far more there. The grammar's lexer caches are warmed by one matcher walking the text first (a
server's steady state: the records of an array repeat).

    PYTHONPATH=$PWD python3 benchmarks/bench_structured_fill.py [--vocab nano synthetic] [--threads 0 1 2 4 8]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import llguidance
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from framework.models.tokenizer import ByteTokenizer  # noqa: E402
from samplers.structured.backend import GuidanceBackend  # noqa: E402
from samplers.structured.bitmask import bitmask_words  # noqa: E402
from samplers.structured.fill import BitmaskFiller, FillJob  # noqa: E402

VOCAB = 151936
# An array of records whose minItems cannot be reached in 1024 tokens: the nano bench's requests never close it.
SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 100000,
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["id", "name", "tags"],
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99999},
            "name": {"type": "string", "maxLength": 12},
            "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["alpha", "beta", "gamma"]}},
        },
    },
}
RECORD = b'{"id":12345,"name":"abcdefgh","tags":["alpha","beta"]},'


class _SyntheticVocabulary:
    """151,936 tokens: the 256 bytes, random printable strings of 2-8 characters, end of sequence last."""

    bos_token_id = None

    def __init__(self, vocab_size: int) -> None:
        rng = random.Random(0)
        chars = [chr(c) for c in range(32, 127)]
        self.tokens = [bytes([i]) for i in range(256)]
        seen = set(self.tokens)
        while len(self.tokens) < vocab_size - 1:
            t = "".join(rng.choice(chars) for _ in range(rng.randint(2, 8))).encode()
            if t not in seen:
                seen.add(t)
                self.tokens.append(t)
        self.tokens.append(b"<|eos|>")
        self.eos_token_id = vocab_size - 1
        self.special_token_ids = [vocab_size - 1]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def tokenizer(vocab: str) -> tuple[llguidance.LLTokenizer, float]:
    """(the llguidance tokenizer of `vocab`, seconds to build it)."""
    t0 = time.perf_counter()
    if vocab == "nano":
        tok = GuidanceBackend(ByteTokenizer(), VOCAB, 256).lltokenizer
    else:
        tok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_SyntheticVocabulary(VOCAB)), n_vocab=VOCAB)
    return tok, time.perf_counter() - t0


def time_fill(
    tok: llguidance.LLTokenizer, fill: Callable[[list[llguidance.LLMatcher], torch.Tensor], None], rows: int, steps: int
) -> tuple[list[float], float]:
    """(wall seconds of each step's `fill(matchers, mask)`, mean CPU seconds of it per step, all threads) over a
    walk of `steps` bytes, matcher i from its own offset. The CPU time also reads on a busy machine."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    text = b"[" + RECORD * (2 + steps // len(RECORD))
    rng = random.Random(1)
    offsets = [rng.randrange(len(RECORD)) for _ in range(rows)]
    mask = torch.zeros(rows, bitmask_words(VOCAB), dtype=torch.int32)
    # Warm the grammar's lexer caches (shared by its matchers) over the whole walk, as a server's steady state:
    # one matcher computes every mask along it.
    warm = llguidance.LLMatcher(tok, grammar, log_level=0)
    for b in text[: max(offsets) + steps + 1]:
        warm.unsafe_compute_mask_ptr(mask.data_ptr(), 4 * mask.shape[1])
        assert warm.consume_token(b)
    matchers = [llguidance.LLMatcher(tok, grammar, log_level=0) for _ in range(rows)]
    for m, off in zip(matchers, offsets):
        assert all(m.consume_token(b) for b in text[:off])
    times, cpu = [], 0.0
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        fill(matchers, mask)
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
        for m, off in zip(matchers, offsets):
            assert m.consume_token(text[off + step])
    return times, cpu / steps


def _executor_fill() -> Callable[[list[llguidance.LLMatcher], torch.Tensor], None]:
    executor = llguidance.LLExecutor()

    def fill(matchers: list[llguidance.LLMatcher], mask: torch.Tensor) -> None:
        executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], mask.data_ptr(), 4 * mask.shape[1], mask.shape[0]
        )

    return fill


def _filler_fill(
    num_threads: int, adaptive: bool = False
) -> Callable[[list[llguidance.LLMatcher], torch.Tensor], None]:
    # Forced: the workers fill every step (the raw cost of N threads); adaptive: as the engine runs it.
    filler = BitmaskFiller(num_threads) if adaptive else BitmaskFiller(num_threads, workers_from_mask_s=0)

    def fill(matchers: list[llguidance.LLMatcher], mask: torch.Tensor) -> None:
        filler.start([FillJob(m, i, []) for i, m in enumerate(matchers)], mask.data_ptr(), 4 * mask.shape[1])
        filler.join()

    return fill


def run(vocabs: list[str], threads: list[int], rows: int = 128, steps: int = 120) -> list[dict[str, Any]]:
    results = []
    for vocab in vocabs:
        tok, build = tokenizer(vocab)
        fills = [("llguidance LLExecutor", _executor_fill())] + [
            (f"filler, {n} threads", _filler_fill(n)) for n in threads
        ]
        fills.append((f"filler, adaptive ({max(threads)} threads)", _filler_fill(max(threads), adaptive=True)))
        vocab_steps = steps if vocab == "nano" else max(1, steps // 2)  # synthetic masks cost ~10x more
        for name, fill in fills:
            wall, cpu = time_fill(tok, fill, rows, vocab_steps)
            t = sorted(wall)
            results.append(
                {
                    "vocab": vocab,
                    "method": name,
                    "rows": rows,
                    "steps": vocab_steps,
                    "tokenizer_build_s": build,
                    "p50_ms": 1e3 * t[len(t) // 2],
                    "p90_ms": 1e3 * t[int(0.9 * len(t))],
                    "mean_ms": 1e3 * statistics.fmean(t),
                    "cpu_ms": 1e3 * cpu,
                }
            )
    return results


def print_table(results: list[dict[str, Any]]) -> None:
    print("| vocabulary | fill | masks / step | wall p50 ms | p90 ms | mean ms | CPU ms (all threads) |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['vocab']} | {r['method']} | {r['rows']} | {r['p50_ms']:.2f} | {r['p90_ms']:.2f} | "
            f"{r['mean_ms']:.2f} | {r['cpu_ms']:.2f} |"
        )


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", nargs="+", choices=["nano", "synthetic"], default=["nano", "synthetic"])
    ap.add_argument("--threads", nargs="+", type=int, default=[0, 1, 2, 4, 8])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--out", type=Path, help="write structured_fill.json here")
    args = ap.parse_args(argv)
    results = run(args.vocab, args.threads, steps=args.steps)
    print_table(results)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured_fill.json").write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
