"""`mrv2 serve`'s protocol around generation, with the official `openai` client and raw HTTP: OpenAI-shaped errors
for bad fields, paths and methods, /v1/models, /version and the Prometheus metrics, API keys, the queue limit and
a clean SIGTERM.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from helpers.serve_helpers import ServerProcess, module_server, openai_client
from prometheus_client.parser import text_string_to_metric_families
from test_serve import PROMPT

pytestmark = pytest.mark.slow

server = module_server()


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


def _metrics(server) -> dict[str, float]:
    values = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            values.setdefault(sample.name, 0.0)
            values[sample.name] += sample.value
    return values


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
    with pytest.raises(openai.BadRequestError) as tools:  # a forced call of a function that is not there
        client.chat.completions.create(
            model="tiny",
            messages=hi,
            max_tokens=2,
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "x"}},
        )
    assert tools.value.body["param"] == "tool_choice" and "'x'" in tools.value.body["message"]
    for extra, param in (
        ({"tool_choice": "required"}, "tool_choice"),  # no tools to call
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
        ({"functions": [tool["function"]], "tool_choice": "auto"}, "tool_choice"),
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
    while "ignored fields not read by this server: 'max_tokenz', 'store'" not in server.stderr_tail():
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
            "tool_calls": [{"id": "c1", "type": "function", "function": {"arguments": "{}"}}],
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
        client.embeddings.create(model="no-such-model", input="hi")  # an unknown model is a 404 too
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


def test_contradictory_constraints_are_a_400_naming_both_fields(server):
    """`allowed_token_ids` that `min_tokens` excludes entirely (stop tokens only) is refused at validation with
    a 400, not failed mid-run as a 500 that clients retry."""
    for extra in (
        {"allowed_token_ids": [7, 9], "stop_token_ids": [9, 7], "min_tokens": 2},
        {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 1, "ignore_eos": True},
    ):
        r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "allowed_token_ids" in message and "min_tokens" in message, message
    assert server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_client_field_names_reach_the_log_escaped(server):
    """An ignored field's name is client text: a newline in it cannot start a forged log line."""
    forged = "max_tokenz\n[ERROR] forged line"
    r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, forged: 1})
    assert r.status_code == 200
    log = server.stderr_tail()
    assert "ignored fields not read by this server: 'max_tokenz\\n[ERROR] forged line'" in log, log
    assert not any(line.startswith("[ERROR] forged line") for line in log.splitlines()), log
