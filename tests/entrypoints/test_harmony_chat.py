"""`LLM.chat` on a tiny random gpt-oss checkpoint chats in harmony: the prompt is openai-harmony's rendering, the
output stops on `<|return|>` / `<|call|>` and is read by channel. A grammar makes the random model write a given
harmony output (its special tokens as llguidance token references), so the whole path is checked end to end;
forced calls (`required`, named) follow harmony's call grammar and their arguments validate."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import torch
from helpers.harmony_models import write_chat_checkpoint, write_vocab

from framework import InvalidRequestError, SamplingParams
from framework.params.structured_outputs import StructuredOutputsParams

TRIP = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "Weather.", "parameters": TRIP}},
    {"type": "function", "function": {"name": "hotels", "parameters": TRIP}},
]
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris for 3 days?"}]


def exactly(harmony_text: str, max_tokens: int = 64) -> SamplingParams:
    """Sampling that makes the model write `harmony_text` (special tokens by name) and nothing else."""
    pieces = [p for p in re.split(r"(<\|[a-z_]+\|>)", harmony_text) if p]
    body = " ".join(p if p.startswith("<|") else json.dumps(p) for p in pieces)
    return SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(grammar=f"start: {body}"))


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from framework import LLM

    model = tmp_path_factory.mktemp("gpt-oss-chat")
    write_chat_checkpoint(write_vocab(tmp_path_factory.mktemp("o200k")), model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(str(model), device="cpu", max_model_len=1024)
    finally:
        torch.set_num_threads(threads)


def test_the_prompt_is_harmonys_and_the_answer_is_read_by_channel(llm):
    text = "<|channel|>analysis<|message|>Short trip.<|end|><|start|>assistant"
    text += "<|channel|>final<|message|>Sunny.<|return|>"
    out = llm.chat(ASK, exactly(text), tools=TOOLS, reasoning_effort="low", use_tqdm=False)[0]
    prompt = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert prompt.startswith("<|start|>system<|message|>") and "Reasoning: low" in prompt
    assert "# Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\nnamespace functions {" in prompt
    assert prompt.endswith("<|start|>user<|message|>Weather in Paris for 3 days?<|end|><|start|>assistant")
    seq = out.outputs[0]
    assert (seq.reasoning_content, seq.text, seq.tool_calls, seq.finish_reason) == ("Short trip.", "Sunny.", [], "stop")
    assert seq.token_ids[-1] == 200002  # the turn ended on <|return|>, a stop token the format adds
    assert seq.reasoning_tokens == len(llm.tokenizer.encode("<|channel|>analysis<|message|>Short trip.<|end|>"))


def test_auto_reads_a_call(llm):
    text = '<|channel|>commentary to=functions.hotels <|constrain|>json<|message|>{"city": "Rome", "days": 2}<|call|>'
    seq = llm.chat(ASK, exactly(text), tools=TOOLS, use_tqdm=False)[0].outputs[0]
    assert seq.finish_reason == "tool_calls" and seq.text == "" and seq.reasoning_content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in seq.tool_calls] == [
        ("hotels", '{"city": "Rome", "days": 2}')
    ]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "hotels"}}])
def test_forced_calls_validate(llm, choice):
    params = SamplingParams(max_tokens=48, temperature=0.9, seed=3, n=2)
    out = llm.chat(ASK, params, tools=TOOLS, tool_choice=choice, use_tqdm=False)[0]
    for seq in out.outputs:
        assert seq.finish_reason == "tool_calls" and seq.text == "" and len(seq.tool_calls) == 1
        call = seq.tool_calls[0]["function"]
        assert call["name"] in (["weather", "hotels"] if choice == "required" else ["hotels"])
        jsonschema.validate(json.loads(call["arguments"]), TRIP)
        assert seq.token_ids[-1] == 200012  # <|call|>


def test_random_output_is_well_formed(llm):
    """Unconstrained, the random model writes no harmony: its text comes back as content, no error."""
    out = llm.chat([ASK, ASK[1:]], SamplingParams(max_tokens=12, temperature=1.0, seed=5), tools=TOOLS, use_tqdm=False)
    for seq in (o.outputs[0] for o in out):
        assert isinstance(seq.text, str) and seq.finish_reason in ("stop", "length", "tool_calls")
        assert seq.tool_calls is not None


def test_refusals_name_the_field(llm):
    with pytest.raises(InvalidRequestError, match="reasoning_effort"):
        llm.chat(ASK, reasoning_effort="extreme", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="thinking_token_budget"):
        llm.chat(ASK, SamplingParams(max_tokens=4, thinking_token_budget=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        llm.chat(ASK, continue_final_message=True, add_generation_prompt=False, use_tqdm=False)


def test_a_request_template_renders_instead(llm):
    template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    out = llm.chat(ASK, SamplingParams(max_tokens=2), chat_template=template, use_tqdm=False)[0]
    assert llm.tokenizer.decode(out.prompt_token_ids) == "Be brief.\nWeather in Paris for 3 days?\n"
