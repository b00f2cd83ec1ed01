"""`mrv2 serve` against the official `openai` client, on 127.0.0.1 at a free port, with the embedded tiny model.

The reference for every served text is offline `LLM.generate` on the same config (greedy), and for every
served vector offline `LLM.encode`.
"""

from __future__ import annotations

import base64
import json
import struct
import time

import httpx
import openai
import pytest
from helpers.serve_helpers import ServerProcess, module_server, openai_client
from prometheus_client.parser import text_string_to_metric_families

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


def _metrics(server) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            values.setdefault(sample.name, 0.0)
            values[sample.name] += sample.value
    return values


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


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, top_p=7)
    assert "top_p" in str(bad.value) and "(0, 1]" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as long:
        client.completions.create(model="tiny", prompt=[1] * 2000, max_tokens=4)
    assert "maximum context length" in str(long.value)
    with pytest.raises(openai.BadRequestError) as vocab:
        client.completions.create(model="tiny", prompt=[10**9], max_tokens=4)
    assert "outside the vocabulary" in str(vocab.value)
    r = server.post("/v1/completions", json={"prompt": [True, False], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = server.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = server.post("/v1/completions", content=b"x" * (33 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    chunked = server.post(
        "/v1/completions", content=iter([b"x" * (16 << 20)] * 3), headers={"content-type": "application/json"}
    )  # no Content-Length: counted as it comes
    assert chunked.status_code == 413
    r = server.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{% for m in messages %}"},
    )
    assert r.status_code == 400 and "parse" in r.json()["error"]["message"]
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as tools:  # refused, not answered as if no tools were sent
        client.chat.completions.create(model="tiny", messages=hi, max_tokens=2, tools=[tool])
    assert tools.value.body["param"] == "tools" and "tool calling is not supported" in tools.value.body["message"]
    for extra, param in (
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [tool["function"]]}, "functions"),
        ({"function_call": {"name": "add"}}, "function_call"),
    ):
        r = server.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "guided_choice": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_choice"  # not an unconstrained reply
    assert 'structured_outputs={"choice": ...}' in r.json()["error"]["message"]
    typo = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "max_tokenz": 9, "store": True})
    assert typo.status_code == 200  # unknown fields are ignored, and named in the server's log
    deadline = time.monotonic() + 10
    while "ignored fields not read by this server: max_tokenz, store" not in server.stderr_tail():
        assert time.monotonic() < deadline, server.stderr_tail()
        time.sleep(0.1)
    r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"  # not n=1 answered as best of 3
    assert server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "best_of": 1}).status_code == 200
    called = [
        *hi,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add"}}],
        },
    ]
    r = server.post("/v1/chat/completions", json={"messages": called, "max_tokens": 2})
    assert r.status_code == 400 and "messages[1].tool_calls" in r.json()["error"]["message"]
    none = server.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 2, "tool_choice": "none"})
    assert none.status_code == 200 and none.json()["usage"]["completion_tokens"] == 2  # no tools asked for
    assert server.get("/health").status_code == 200  # nothing above broke the server
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_unknown_paths_and_methods_are_openai_shaped(server, client):
    """Not only the endpoints' own errors: a path or method the server does not have is an OpenAI error too."""
    for response, status in ((server.post("/v1/no-such-endpoint", json={}), 404), (server.get("/v1/completions"), 405)):
        assert response.status_code == status
        assert response.json()["error"]["code"] == status and response.json()["error"]["message"], response.text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="hi")  # the Responses API is not served
    assert server.get("/health").status_code == 200


def test_stream_options_without_stream_is_refused(server):
    """OpenAI refuses `stream_options` on a request that does not stream (its usage chunk would never come)."""
    for path, body in (
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = server.post(path, json={**body, "max_tokens": 2, "stream_options": {"include_usage": True}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    assert server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_too_many_logprobs_name_the_field_sent(server):
    """The engine's limit (sampler.max_logprobs) is refused under the name the client used, chat's top_logprobs
    included, not the engine's `logprobs` with an internal request id."""
    hi = [{"role": "user", "content": "hi"}]
    for path, body, param in (
        ("/v1/completions", {"prompt": PROMPT, "logprobs": 21}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/chat/completions", {"messages": hi, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        r = server.post(path, json={**body, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert f"{param}=21" in r.json()["error"]["message"] and "max_logprobs=20" in r.json()["error"]["message"]


def test_models_version_metrics(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert server.get("/version").json()["version"]
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3)
    m = _metrics(server)
    for name in (
        "mrv2:num_requests_running",
        "mrv2:num_requests_waiting",
        "mrv2:kv_cache_usage_perc",
        "mrv2:prompt_tokens_total",
        "mrv2:generation_tokens_total",
        "mrv2:time_to_first_token_seconds_count",
        "mrv2:time_per_output_token_seconds_count",
        "mrv2:e2e_request_latency_seconds_count",
        "mrv2:prefix_cache_queries_total",
        "mrv2:prefix_cache_hits_total",
        "mrv2:spec_decode_num_draft_tokens_total",
        "mrv2:spec_decode_num_accepted_tokens_total",
    ):
        assert name in m, name
    assert m["mrv2:generation_tokens_total"] >= 3 and m["mrv2:e2e_request_latency_seconds_count"] >= 1


def test_auth_queue_limit_and_sigterm():
    with ServerProcess("serve.api_key=sekrit", "scheduler.max_num_seqs=1", "serve.max_queued_requests=0") as s:
        r = s.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=s.base_url, api_key="sekrit", max_retries=0, timeout=60)
        assert ok.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert s.get("/health").status_code == 200  # health and metrics need no key
        headers = {"Authorization": "Bearer sekrit"}
        # One request runs (max_num_seqs=1) and none may wait: a second one in flight gets 503 + Retry-After.
        with httpx.stream(
            "POST",
            f"{s.url}/v1/completions",
            headers=headers,
            timeout=60,
            json={"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True},
        ) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            busy = s.post("/v1/completions", headers=headers, json={"prompt": PROMPT, "max_tokens": 2})
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            code = None
            s.proc.send_signal(15)  # SIGTERM while a stream is in flight: it ends with an error event
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"
            assert "shutting down" in json.loads(rest[-2][6:])["error"]["message"]
        code = s.stop(timeout=30)
        assert code == 0


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
    # Any whitespace is allowed (vLLM's default): some samples loop on it until max_tokens.
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
