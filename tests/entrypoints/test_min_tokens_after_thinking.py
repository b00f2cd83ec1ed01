"""min_tokens against a grammar that waits for the thinking: under a thinking budget the grammar constrains the
answer only, so the output can hold the longest thinking (the budget plus the forced `</think>` tokens) before the
grammar's longest answer. A min_tokens that thinking plus answer can meet runs and holds; one that no output can
meet is refused at validation, naming min_tokens, the grammar and the budget. On the embedded tiny model with a
template that opens the thinking."""

from __future__ import annotations

import pytest
from helpers.thinking_chat import THINKING_TEMPLATE, tiny_llm_on_one_thread

from framework import SamplingParams
from framework.params.request_errors import InvalidRequestError
from framework.params.structured_outputs import StructuredOutputsParams

ASK = [{"role": "user", "content": "a or b?"}]
BUDGET = 3
CHOICE = StructuredOutputsParams(choice=["a"])  # one token of answer


@pytest.fixture(scope="module")
def llm():  # type: ignore[no-untyped-def]
    yield from tiny_llm_on_one_thread()


def _chat(llm, min_tokens: int, budget):  # type: ignore[no-untyped-def]
    params = SamplingParams(
        max_tokens=16, min_tokens=min_tokens, temperature=0.9, seed=7, structured_outputs=CHOICE,
        thinking_token_budget=budget,
    )  # fmt: skip
    out = llm.chat(ASK, params, chat_template=THINKING_TEMPLATE, reasoning_parser="qwen3", use_tqdm=False)
    return out[0].outputs[0]


def test_min_tokens_met_by_thinking_and_answer_runs(llm):  # type: ignore[no-untyped-def]
    end = len(llm.tokenizer.encode("</think>"))
    need = BUDGET + end + 1  # the longest thinking and the answer: more than the grammar alone allows
    with pytest.raises(InvalidRequestError, match="always ends before"):
        _chat(llm, need, None)  # no budget: the grammar applies from the first token and cannot last that long
    seq = _chat(llm, need, BUDGET)
    assert seq.finish_reason == "stop" and seq.text == "a" and seq.reasoning_content
    assert len(seq.token_ids) >= need and seq.reasoning_tokens == BUDGET + end


def test_min_tokens_no_output_can_meet_is_refused_naming_both(llm):  # type: ignore[no-untyped-def]
    longest = BUDGET + len(llm.tokenizer.encode("</think>")) + 1
    with pytest.raises(InvalidRequestError) as err:
        _chat(llm, longest + 1, BUDGET)
    message = str(err.value)
    assert "structured_outputs.choice always ends before" in message and f"min_tokens={longest + 1}" in message
    assert f"thinking_token_budget={BUDGET}" in message
