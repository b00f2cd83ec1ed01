"""Every registered reasoning parser streams exactly its non-streamed parse: for canned outputs (thinking opened by
the template, by a thinking budget or not at all; `</think>` reached or not; tags split anywhere), every way of
cutting the output into deltas joins to the same reasoning and answer as `extract` of the whole, and the built-in
parsers' parse is the one documented (`framework/entrypoints/reasoning_parser.py`). The planted-fault control
streams a template-opened section as answer (the bug this file was written for) and must fail."""

from __future__ import annotations

import itertools

import pytest

from framework.config.registry import REASONING_PARSERS
from framework.entrypoints.reasoning_parser import ThinkReasoningParser, make_reasoning_parser

PLAIN = "# user:\n# 2+3?\n# assistant:\n"
OPENED = PLAIN + "<think>\n"  # a template that opens the thinking (DeepSeek-R1, Qwen3 thinking variants)
ANSWER = "It is 5."
# (output, (reasoning, answer) when the template did not open the thinking, (...) when it did)
CANNED = [
    ("<think>\nFirst, 2+3.\n</think>\n\n" + ANSWER, ("First, 2+3.", ANSWER), ("First, 2+3.", ANSWER)),
    ("First, 2+3.\n</think>\n\n" + ANSWER, ("", "First, 2+3.\n</think>\n\n" + ANSWER), ("First, 2+3.", ANSWER)),
    (ANSWER, ("", ANSWER), (ANSWER, "")),
    ("<think>\nStill thinking  \n", ("Still thinking", ""), ("Still thinking", "")),
    ("Still  thinking \n", ("", "Still  thinking \n"), ("Still  thinking", "")),
    (" <thinker> a</think>b", ("", " <thinker> a</think>b"), ("<thinker> a", "b")),
    ("<thi", ("", "<thi"), ("<thi", "")),
    ("a </th", ("", "a </th"), ("a </th", "")),
    ("</think>", ("", "</think>"), ("", "")),
    ("x</think> ", ("", "x</think> "), ("x", "")),
    (" \n<think>a < b</thin </think>\n <x>{}", ("a < b</thin", "<x>{}"), ("a < b</thin", "<x>{}")),
    ("", ("", ""), ("", "")),
]
BUILT_IN = {"think": False, "qwen3": False, "deepseek_r1": True}  # always opened by the template


def _splits(text: str):  # type: ignore[no-untyped-def]
    """Every cut of a short output; for a longer one every cut into two or three pieces and one-character pieces.
    The last delta may be empty (a stream's final event without new text)."""
    n = len(text)
    if n <= 12:
        cuts = [c for k in range(n) for c in itertools.combinations(range(1, n), k)]
    else:
        cuts = [(i,) for i in range(1, n)] + list(itertools.combinations(range(1, n), 2)) + [tuple(range(1, n))]
    for cut in cuts:
        bounds = (0, *cut, n)
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        yield pieces
        yield [*pieces, ""]


def _streamed(name: str, prompt: str, pieces: list[str], budgeted: bool = False) -> tuple[str, str]:
    parser = make_reasoning_parser(name, prompt, budgeted)
    got = [parser.extract_delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return "".join(r for r, _ in got), "".join(a for _, a in got)


@pytest.mark.parametrize("name", REASONING_PARSERS.names())
@pytest.mark.parametrize(
    "prompt, budgeted",
    [(PLAIN, False), (OPENED, False), (PLAIN, True)],
    ids=["plain-prompt", "template-opened", "thinking-budget"],  # a budget: the output starts in the thinking
)
def test_every_split_streams_the_whole_parse(name, prompt, budgeted):  # type: ignore[no-untyped-def]
    for text, plain, opened in CANNED:
        whole = make_reasoning_parser(name, prompt, budgeted).extract(text)
        if name in BUILT_IN:
            assert whole == (opened if BUILT_IN[name] or prompt == OPENED or budgeted else plain), (name, text)
        for pieces in _splits(text):
            assert _streamed(name, prompt, pieces, budgeted) == whole, (name, pieces)


def test_planted_fault_template_opened_thinking_streamed_as_answer(monkeypatch):  # type: ignore[no-untyped-def]
    """Control: a stream that ignores the prompt (the old `qwen3` behaviour) streams the template-opened thinking
    as answer, unlike the whole parse; the split check above must catch it."""
    real = ThinkReasoningParser._decide

    def ignore_prompt(self, final: bool) -> bool:  # type: ignore[no-untyped-def]
        opened, self.opened = self.opened, self.opened_by_template  # the prompt and the budget unread
        try:
            return real(self, final)
        finally:
            self.opened = opened

    monkeypatch.setattr(ThinkReasoningParser, "_decide", ignore_prompt)
    assert _streamed("qwen3", OPENED, list(CANNED[1][0])) == ("", CANNED[1][0])
    with pytest.raises(AssertionError):
        test_every_split_streams_the_whole_parse("qwen3", OPENED, False)
