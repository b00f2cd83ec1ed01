"""`mrv2 serve` at its edges, on one small server (2 slots, no queue beyond them): values no engine tensor can
hold, requests that must not keep capacity after they fail, and a non-streaming client that leaves while its
tokens are still coming."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from helpers.serve_helpers import ServerProcess
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def server():
    with ServerProcess(f"scheduler.max_num_seqs={MAX_NUM_SEQS}", "serve.max_queued_requests=0") as s:
        yield s


def _metrics(server) -> dict[str, float]:
    """Samples by name, with `finished_reason` appended to the request counter's name (`..._total:abort`)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get("/metrics").text):
        for sample in family.samples:
            reason = sample.labels.get("finished_reason")
            name = f"{sample.name}:{reason}" if reason else sample.name
            values[name] = values.get(name, 0.0) + sample.value
    return values


def _wait_idle(server, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(server)
        if m["mrv2:num_requests_running"] == 0 and m["mrv2:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def _full_capacity_works(server) -> None:
    """MAX_NUM_SEQS requests at once all succeed: no earlier request still holds a place in flight (with no queue,
    one leaked place turns the last of them into a 503)."""

    async def one(client: httpx.AsyncClient) -> int:
        body = {"prompt": PROMPT, "max_tokens": 32, "ignore_eos": True}
        return (await client.post(f"{server.url}/v1/completions", json=body)).status_code

    async def all_at_once() -> list[int]:
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*[one(client) for _ in range(MAX_NUM_SEQS)])

    assert asyncio.run(all_at_once()) == [200] * MAX_NUM_SEQS


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"seed": 2**63}, "seed"),  # fits msgpack, not the engine's int64 seed table
        ({"seed": 2**64}, "seed"),  # fits neither
        ({"prompt": [-1]}, "prompt"),  # not a token id (the tokenizer cannot even decode it)
        ({"prompt": [2**64]}, "prompt"),
        ({"stop_token_ids": [2**64]}, None),
        ({"logit_bias": {str(2**64): 1}}, None),
    ],
)
def test_out_of_range_integers_are_400s_that_keep_no_capacity(server, extra, param):
    r = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == 400 and (param is None or error["param"] == param), error
    _full_capacity_works(server)


def test_a_huge_top_k_filters_nothing_and_fails_no_one(server):
    """top_k beyond the vocabulary keeps every token (as vLLM does); it must not overflow the engine's table and
    end the step of every running request with it."""
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30)
    params = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=11)
    plain = client.completions.create(**params).choices[0].text
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        timeout=30,
        json={"prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True},
    ) as running:
        lines = running.iter_lines()
        assert next(lines).startswith("data: ")  # the bystander is running
        huge = client.completions.create(**params, extra_body={"top_k": 2**40})
        assert huge.choices[0].text == plain
        bad_seed = server.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "seed": 2**63})
        assert bad_seed.status_code == 400 and bad_seed.json()["error"]["param"] == "seed"
        frames = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert all("error" not in f for f in frames), frames[-1]
    assert frames[-1]["choices"][0]["finish_reason"] == "length"
    assert server.get("/health").status_code == 200


def test_a_non_streaming_client_that_leaves_mid_generation_is_aborted(server):
    before = _wait_idle(server)
    body = {"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "n": 2}  # seconds of tokens on the CPU
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    after = _wait_idle(server, timeout_s=30)
    assert after["mrv2:num_requests_running"] == 0
    aborted = after.get("mrv2:request_success_total:abort", 0) - before.get("mrv2:request_success_total:abort", 0)
    generated = after["mrv2:generation_tokens_total"] - before["mrv2:generation_tokens_total"]
    assert aborted == 1 and generated < 2 * 1000, (aborted, generated)
    _full_capacity_works(server)
    # The server's log says so in one line, not an ASGI traceback.
    log = server.stderr_tail()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log
    assert sum("client disconnected" in line for line in log.splitlines()) == 1, log
