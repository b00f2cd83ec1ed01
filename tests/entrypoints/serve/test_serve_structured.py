"""Structured outputs and chat behind `mrv2 serve` (127.0.0.1, the embedded tiny model): what a client sees
besides the constrained text (logprobs under a grammar, grammar errors named by the field the client sent) and
chat fields that clash with what the server passes to the template."""

from __future__ import annotations

import json
import math

import pytest
from helpers.serve_helpers import module_server, openai_client

pytestmark = pytest.mark.slow
CHOICE = {"structured_outputs": {"choice": ["ab", "cd"]}}


server = module_server()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _strict_json(text: str):  # type: ignore[no-untyped-def]
    """JSON as the RFC has it: NaN and Infinity are not JSON (many clients' parsers refuse them)."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_logprobs_of_tokens_the_grammar_forbids_are_finite_json(server):
    """The grammar masks tokens to -inf before the logprobs; a top-N list reaches them (here: after the first
    letter, every token but one is forbidden). The body must still be JSON, with vLLM's floor of -9999."""
    r = server.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, "logprobs": 2, **CHOICE})
    assert r.status_code == 200, r.text
    lps = _strict_json(r.text)["choices"][0]["logprobs"]
    values = lps["token_logprobs"] + [v for top in lps["top_logprobs"] for v in top.values()]
    assert min(values) == -9999.0 and all(math.isfinite(v) for v in values)
    streamed = server.post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 4, "logprobs": 2, "stream": True, **CHOICE}
    )
    frames = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and all("error" not in _strict_json(f) for f in frames[:-1])
    chat = server.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 4,
            "logprobs": True,
            "top_logprobs": 2,
            **CHOICE,
        },
    )
    assert chat.status_code == 200, chat.text
    content = _strict_json(chat.text)["choices"][0]["logprobs"]["content"]
    assert min(t["logprob"] for c in content for t in c["top_logprobs"]) == -9999.0


@pytest.mark.parametrize(
    "body, param, names",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "response_format",
            "response_format.json_schema.schema is invalid",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "(["}},
                }
            },
            "response_format",
            "response_format.json_schema.schema is invalid",
        ),
        ({"structured_outputs": {"regex": "([a-"}}, "structured_outputs", "structured_outputs.regex is invalid"),
        (
            {"structured_outputs": {"json": {"type": "strin"}}},
            "structured_outputs",
            "structured_outputs.json is invalid",
        ),
    ],
)
def test_grammar_errors_name_the_field_the_client_sent(server, client, body, param, names):
    """The engine compiles the grammar and refuses it under its own name (SamplingParams.structured_outputs);
    the client sent response_format or structured_outputs, and the error names that."""
    r = server.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body}
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and names in error["message"], r.text
    assert "SamplingParams" not in error["message"]
    assert client.completions.create(model="tiny", prompt="x", max_tokens=3, extra_body=CHOICE).choices[0].text in (
        "ab",
        "cd",
    )  # and the server serves on


@pytest.mark.parametrize("name", ["add_generation_prompt", "continue_final_message", "messages", "bos_token"])
def test_chat_template_kwargs_that_the_server_sets_are_refused_by_name(server, name):
    """The server passes these to the template itself: a clash is the client's field, not a Python TypeError about
    `ChatTemplate.render()` under `messages`."""
    r = server.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "chat_template_kwargs": {name: False}},
    )
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "chat_template_kwargs", r.text
    assert f"chat_template_kwargs.{name}" in error["message"] and "render()" not in error["message"]


@pytest.mark.parametrize(
    "body, names",
    [
        (CHOICE, "structured_outputs.choice"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "boolean"}},
                }
            },
            "response_format.json_schema.schema",
        ),
    ],
)
def test_a_grammar_that_ends_before_min_tokens_is_refused_naming_both(server, body, names):
    """A grammar whose every output is shorter than min_tokens leaves no token to sample once it ends (min_tokens
    forbids end of sequence): a 400 at validation naming both fields, never a failed request mid-run."""
    r = server.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 12, "min_tokens": 8, **body},
    )
    error = r.json()["error"]
    assert r.status_code == 400, r.text
    assert names in error["message"] and "min_tokens=8" in error["message"] and "SamplingParams" not in error["message"]
    ok = server.post(  # a grammar with a long enough output is served, and min_tokens holds
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 12, "min_tokens": 6, "structured_outputs": {"regex": "[a-c]{2,10}"}},
    )
    assert ok.status_code == 200, ok.text
    assert 6 <= len(ok.json()["choices"][0]["text"]) <= 10
