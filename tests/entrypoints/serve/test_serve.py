"""`mrv2 serve` against the official `openai` client, on 127.0.0.1 at a free port, with the embedded tiny model.

The reference for every served text is offline `LLM.generate` on the same config (greedy), and for every
served vector offline `LLM.encode`.
"""

from __future__ import annotations

import base64
import json
import struct

import openai
import pytest
from helpers.serve_helpers import module_server, openai_client

from framework import LLM, SamplingParams
from framework.config.schema import load_config
from framework.entrypoints.chat_template import ChatTemplate

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"


server = module_server()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def offline():
    llm = LLM("tiny", device="cpu")
    yield llm
    llm.shutdown()


def test_greedy_completion_equals_offline_and_stream_joins_to_it(client, offline):
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert got.usage.completion_tokens == 24 and got.usage.total_tokens == got.usage.prompt_tokens + 24
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_text_is_left_out_as_offline(client, offline, include):
    """A request ended by a `stop_token_ids` entry: the served text (whole and streamed) is offline's, which
    leaves that token's text out unless `include_stop_str_in_output` (vLLM's semantics)."""
    free = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids
    stop_at = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i] and offline.tokenizer.decode([t]))
    params = dict(temperature=0, max_tokens=12, stop_token_ids=[stop_at], include_stop_str_in_output=include)
    want = offline.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0]
    assert want.stop_reason == stop_at and want.text.endswith(offline.tokenizer.decode([stop_at])) == include
    extra = {k: v for k, v in params.items() if k in ("stop_token_ids", "include_stop_str_in_output")}
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "stop"
    chunks = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=extra, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text


def test_prompt_forms_token_ids_and_batches(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([PROMPT, "import os\n"], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == want[0].text
    batch = client.completions.create(model="tiny", prompt=[PROMPT, "import os\n"], max_tokens=8, temperature=0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [w.text for w in want]
    echo = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True)
    assert echo.choices[0].text == PROMPT + want[0].text


def test_n_sequences_with_a_seed(client, offline):
    params = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=7)
    three = client.completions.create(n=3, **params)
    assert sorted(c.index for c in three.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # each sequence samples with its own seed
    one = client.completions.create(n=1, **params)
    assert one.choices[0].text == texts[0]  # sequence 0 samples with the request's seed
    offline_three = offline.generate(
        [PROMPT], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False
    )[0]
    assert [o.text for o in offline_three.outputs] == texts
    assert three.usage.completion_tokens == sum(len(o.token_ids) for o in offline_three.outputs)


def test_completion_top_logprobs_always_hold_the_sampled_token(client):
    """OpenAI's completions: `logprobs=k` gives the k most likely tokens and always the sampled one, up to k + 1
    entries; sampled at temperature 2 from one candidate, the sampled token is mostly outside the top 1."""
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=2.0, seed=3, logprobs=1)
    lp = got.choices[0].logprobs
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(value) and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at least one sampled token outside the top 1


def test_logprobs_completion_and_chat(client, offline):
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0.0
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the chosen token is the most likely
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, logprobs=3), use_tqdm=False)[0]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for e, t in zip(want.logprobs, want.token_ids)], abs=1e-4)
    ids = offline.tokenizer.encode(PROMPT)
    with_prompt = client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 1}
    )
    plp = with_prompt.choices[0].model_extra["prompt_logprobs"]
    want_plp = offline.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[
        0
    ].prompt_logprobs
    assert plp[0] is None and len(plp) == len(ids)
    assert [e[str(t)]["logprob"] for e, t in zip(plp[1:], ids[1:])] == pytest.approx(
        [w[t].logprob for w, t in zip(want_plp[1:], ids[1:])], abs=1e-4
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "sum a list"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content


def test_streamed_completion_logprobs_join_to_the_full_ones(client):
    """Each chunk's `text_offset` continues where the previous chunk's text ended (after the echoed prompt too),
    so the chunks' logprobs concatenate to the non-streamed response's."""
    for echo in (False, True):
        params = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2, echo=echo)
        full = client.completions.create(**params).choices[0]
        chunks = [c.choices[0] for c in client.completions.create(**params, stream=True) if c.choices]
        assert len(chunks) > 2
        joined = {key: [v for c in chunks for v in getattr(c.logprobs, key)] for key in ("tokens", "text_offset")}
        assert joined == {"tokens": full.logprobs.tokens, "text_offset": full.logprobs.text_offset}
        assert "".join(c.text for c in chunks) == full.text
        assert full.logprobs.text_offset[-1] == len(full.text) - len(full.logprobs.tokens[-1])


def test_chat_uses_the_shipped_template_and_streams(client, offline):
    messages = [{"role": "system", "content": "Python only."}, {"role": "user", "content": "reverse a string"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    template = ChatTemplate.load(load_config({}))
    assert want.prompt == template.render(messages)
    got = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(offline.tokenizer.encode(want.prompt))
    chunks = list(
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    cont = client.chat.completions.create(
        model="tiny",
        messages=[*messages, {"role": "assistant", "content": "def reverse(s):"}],
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    want_cont = offline.generate(
        [
            template.render(
                [*messages, {"role": "assistant", "content": "def reverse(s):"}],
                add_generation_prompt=False,
                continue_final_message=True,
            )
        ],
        SamplingParams(temperature=0, max_tokens=8),
        use_tqdm=False,
    )[0]
    assert cont.choices[0].message.content == want_cont.text


def test_stop_strings_and_extra_sampling_fields(client, offline):
    free = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert stop and stop in free
    want = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
                )
            )
            text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert text == want.text == free[: free.index(stop)] and reason == "stop"
    extra = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0.9,
        seed=3,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 10, "ignore_eos": True},
    )
    want_extra = offline.generate(
        [PROMPT],
        SamplingParams(
            temperature=0.9,
            seed=3,
            max_tokens=10,
            top_k=5,
            min_p=0.05,
            repetition_penalty=1.2,
            min_tokens=10,
            ignore_eos=True,
        ),
        use_tqdm=False,
    )[0]
    assert extra.choices[0].text == want_extra.text and extra.usage.completion_tokens == 10


def test_embeddings_equal_offline(client, offline):
    want = offline.encode(["hello world", "def f():"], use_tqdm=False)
    got = client.embeddings.create(model="tiny", input=["hello world", "def f():"])
    for w, g in zip(want, sorted(got.data, key=lambda d: d.index)):
        assert g.embedding == pytest.approx(w.embedding, abs=1e-5)
    small = client.embeddings.create(model="tiny", input="hello world", dimensions=8, encoding_format="float")
    assert len(small.data[0].embedding) == 8
    packed = client.embeddings.create(model="tiny", input="hello world", dimensions=8, encoding_format="base64")
    unpacked = struct.unpack("<8f", base64.b64decode(packed.data[0].embedding))  # little-endian float32
    assert list(unpacked) == pytest.approx(small.data[0].embedding, abs=1e-6)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_structured_outputs_json_schema_choice_regex(client):
    import jsonschema

    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    # At most one space between JSON tokens (the default): samples close their JSON.
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "a person"}],
        response_format=fmt,
        max_tokens=60,
        temperature=0.9,
        seed=2,
        n=4,
    )
    stopped = [c for c in got.choices if c.finish_reason == "stop"]
    assert stopped
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    compact = client.completions.create(
        model="tiny",
        prompt="person = ",
        max_tokens=60,
        temperature=0.9,
        n=4,
        seed=5,
        extra_body={"structured_outputs": {"json": PERSON, "disable_any_whitespace": True}},
    )
    for choice in compact.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    anything = client.completions.create(
        model="tiny",
        prompt="data = ",
        max_tokens=120,
        temperature=0.9,
        seed=1,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)
    pick = client.completions.create(
        model="tiny",
        prompt="color = ",
        max_tokens=10,
        temperature=1.0,
        n=3,
        seed=2,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert all(c.text in ("red", "green", "blue") and c.finish_reason == "stop" for c in pick.choices)
    digits = client.completions.create(
        model="tiny",
        prompt="x = ",
        max_tokens=10,
        temperature=1.0,
        stream=True,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert "".join(c.choices[0].text for c in digits).isdigit()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"structured_outputs": {"regex": "([a-"}}
        )
    assert "regex" in str(bad.value)
    with pytest.raises(openai.BadRequestError) as missing:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"response_format": {"type": "json_schema"}}
        )
    assert "response_format" in str(missing.value)


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_stop_string_boundary_agrees_with_offline(client, offline, stream):
    """A stop string completed by exactly the `min_tokens`-th token: the server's own text path (SequenceText)
    ends the sequence where offline does, for min_tokens on both sides of that token."""
    from helpers.stop_cases import stop_completed_by_token

    free = offline.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    k, stop = stop_completed_by_token(offline.tokenizer, free[0].token_ids)
    for min_tokens in (k - 1, k, k + 1):
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        want = offline.generate([PROMPT], params, use_tqdm=False)[0]
        assert (want.finish_reason == "stop") == (min_tokens <= k), (min_tokens, k, want.finish_reason)
        extra = dict(min_tokens=min_tokens, ignore_eos=True)
        got = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop], extra_body=extra, stream=stream
        )
        if stream:
            chunks = list(got)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = got.choices[0].text, got.choices[0].finish_reason
        assert (text, reason) == (want.text, want.finish_reason), (min_tokens, k)
