"""Every stream gets every engine step's tokens as that step's own event, even when the API server is behind.

The real API server runs with the stand-in engine core (`fake_engine_core`): the token of engine step s is the
letter `a + s % 26`, so a stream's text tells which step each character came from. The core sends its steps in
groups of four (`--steps-per-message 4`): the server finds four steps waiting at once on every read, which is
what a server that fell four steps behind sees, made deterministic (no timing in the test). A server that merges
the waiting steps of a stream into one event fails `check_one_step_per_event`; the planted-fault control below
feeds it such a stream.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from framework.entrypoints.bench.fake_engine_core import step_token
from framework.entrypoints.bench.stream_client import StreamRecord
from framework.entrypoints.bench.stream_harness import HarnessServer, run_load

NUM_STREAMS = 24
NUM_TOKENS = 40
LETTERS = [chr(step_token(s)) for s in range(26)]


def check_one_step_per_event(record: StreamRecord, num_tokens: int) -> None:
    """Each event holds one token (one letter), and consecutive events hold consecutive steps' letters."""
    texts = record.event_texts
    assert record.completion_tokens == num_tokens
    assert all(len(t) == 1 for t in texts), f"an event holds tokens of several steps: {texts}"
    assert len(texts) == num_tokens, f"{num_tokens} tokens came in {len(texts)} events"
    for previous, current in zip(texts, texts[1:]):
        assert LETTERS.index(current) == (LETTERS.index(previous) + 1) % 26, f"a step is missing or reordered: {texts}"


@pytest.fixture(scope="module")
def grouped_steps_server(tmp_path_factory: pytest.TempPathFactory):
    server = HarnessServer(2.0, NUM_STREAMS, Path(tmp_path_factory.mktemp("streams")), steps_per_message=4)
    try:
        yield server
    finally:
        server.stop()


def test_each_step_is_its_own_event_when_the_server_is_behind(grouped_steps_server: HarnessServer) -> None:
    run, records = run_load(grouped_steps_server, NUM_STREAMS, NUM_TOKENS, keep_text=True)
    assert len(records) == NUM_STREAMS
    for record in records:
        check_one_step_per_event(record, NUM_TOKENS)
    assert run.tokens_per_event == 1.0
    # The four steps of a message go out in one write: the events of a stream are packed, not merged.
    assert run.tokens_per_http_chunk > 1.0


def test_a_single_stream_is_one_event_per_step(grouped_steps_server: HarnessServer) -> None:
    _, records = run_load(grouped_steps_server, 1, 9, keep_text=True)
    check_one_step_per_event(records[0], 9)


def test_planted_fault_a_stream_that_merges_steps_fails_the_check() -> None:
    """The control: the same stream with two steps merged into one event (what the server did when it caught up
    with one event per stream) and with a step lost."""
    merged = StreamRecord(0.0, event_times=[0.0] * 3, event_texts=["a", "bc", "d"], completion_tokens=4)
    with pytest.raises(AssertionError, match="several steps"):
        check_one_step_per_event(merged, 4)
    lost = StreamRecord(0.0, event_times=[0.0] * 3, event_texts=["a", "b", "d"], completion_tokens=3)
    with pytest.raises(AssertionError, match="missing"):
        check_one_step_per_event(lost, 3)


def test_the_harness_client_reads_a_stream_as_the_openai_client_does(grouped_steps_server: HarnessServer) -> None:
    """The measuring client is checked against the official openai client on the same server: same text, and
    one openai chunk per event the harness counts."""
    import openai

    async def both() -> tuple[list[str], int]:
        client = openai.AsyncOpenAI(
            base_url=f"http://{grouped_steps_server.host}:{grouped_steps_server.port}/v1",
            api_key="x",
            max_retries=0,
            timeout=60,
        )
        stream = await client.completions.create(
            model="qwen3-0.6b", prompt=[97, 98], max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
        texts, usage = [], 0
        async for chunk in stream:
            if chunk.choices:
                texts.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        await client.close()
        return texts, usage

    texts, usage = asyncio.run(both())
    assert usage == 12 and len(texts) == 12 and all(len(t) == 1 for t in texts)
    _, records = run_load(grouped_steps_server, 1, 12, keep_text=True)
    assert len(records[0].event_texts) == len(texts)
