"""The output processor skips quiet rows while they run and still gives their exact final output."""

from __future__ import annotations

import pytest

from framework.engine.output_processor import OutputProcessor
from framework.engine.request import Request, RequestStatus
from framework.models.tokenizer import ByteTokenizer
from framework.params.sampling_params import SamplingParams
from framework.runner.async_output import ModelRunnerOutput


class _Scheduler:
    def finish_request(self, request_id, status):  # type: ignore[no-untyped-def]
        raise AssertionError("no stop string here")


@pytest.mark.parametrize("told", [False, True], ids=["every-row-looked-at", "told-what-ended"])
def test_quiet_rows_are_skipped_while_running_and_decoded_once_at_the_end(monkeypatch, told):
    """Told what ended (as the engine tells it), the processor drops quiet running rows by a set test; not
    told, it looks at each row's status. The outputs are the same."""
    op = OutputProcessor(ByteTokenizer(), _Scheduler())
    quiet = Request("q", [1], SamplingParams(max_tokens=8))
    stream = Request("s", [1], SamplingParams(max_tokens=8, output_kind="delta"))
    logged = Request("l", [1], SamplingParams(max_tokens=8, logprobs=0))
    requests = [quiet, stream, logged]
    for r in requests:
        r.status = RequestStatus.RUNNING
        op.add_request(r)
    seen: list[str] = []
    add_tokens = op._add_tokens
    monkeypatch.setattr(
        op, "_add_tokens", lambda state, lp: (seen.append(state.request.request_id), add_tokens(state, lp))
    )
    text = "hello!"
    outputs = []
    for i, ch in enumerate(text):
        for r in requests:
            r.output_token_ids.append(ord(ch))
        ended = []
        if i == len(text) - 1:
            for r in requests:
                r.status = RequestStatus.FINISHED_LENGTH
            ended = requests
        step = ModelRunnerOutput([r.request_id for r in requests], [[ord(ch)]] * 3)
        outputs += op.process(step, ended) if told else op.process(step)
    assert seen.count("q") == 2  # its first token (timed) and its end; every step of the others
    assert seen.count("s") == seen.count("l") == len(text)
    finals = {o.request_id: o for o in outputs if o.finished}
    assert finals["q"].text == text and finals["q"].token_ids == [ord(c) for c in text]
    assert finals["q"].metrics.first_token_time is not None
    assert "".join(o.text for o in outputs if o.request_id == "s") == text
    assert not [o for o in outputs if o.request_id == "q" and not o.finished]


def test_a_quiet_request_that_ends_is_reported_only_when_listed():
    """The contract of `finished`: a quiet running request's end is seen through the list (the engine passes
    what `update_from_output` returned). Negative control: left off the list, its end goes unseen."""
    op = OutputProcessor(ByteTokenizer(), _Scheduler())
    quiet = Request("q", [1], SamplingParams(max_tokens=2))
    quiet.status = RequestStatus.RUNNING
    op.add_request(quiet)
    quiet.output_token_ids.append(ord("a"))
    assert op.process(ModelRunnerOutput(["q"], [[ord("a")]]), []) == []  # first token timed; now skipped
    quiet.output_token_ids.append(ord("b"))
    quiet.status = RequestStatus.FINISHED_LENGTH
    step = ModelRunnerOutput(["q"], [[ord("b")]])
    assert op.process(step, []) == []  # not listed: not looked at
    (final,) = op.process(step, [quiet])
    assert final.finished and final.text == "ab" and final.finish_reason == "length"
    assert op.process(step, [quiet]) == []  # reported once


class _RecordingScheduler:
    def __init__(self) -> None:
        self.finished: list[tuple[str, RequestStatus]] = []

    def finish_request(self, request_id, status):  # type: ignore[no-untyped-def]
        self.finished.append((request_id, status))


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_before_a_stop_token_of_the_same_step_wins(include):
    """Several tokens in one step (speculative decoding) of which an early one completes a stop string and the last
    is a stop token: the request ends at the stop string (text cut there, later tokens dropped, stop_reason the
    string), as vLLM does; before, the stop token's step skipped the stop-string search."""
    op = OutputProcessor(ByteTokenizer(), _RecordingScheduler())
    params = SamplingParams(max_tokens=16, stop=["cd"], stop_token_ids=[ord("!")], include_stop_str_in_output=include)
    request = Request("r", [1], params)
    request.status = RequestStatus.RUNNING
    op.add_request(request)
    tokens = [ord(c) for c in "abcde!"]
    request.output_token_ids.extend(tokens)
    request.status = RequestStatus.FINISHED_STOPPED  # the scheduler saw the stop token "!"
    request.stop_token_id = ord("!")
    (final,) = op.process(ModelRunnerOutput(["r"], [tokens]), [request])
    assert final.text == ("abcd" if include else "ab") and final.token_ids == tokens[:4]
    assert final.finish_reason == "stop" and final.stop_reason == "cd"


def test_a_stop_token_alone_keeps_its_stop_reason():
    """Negative control: no stop string in the text, the stop token's step ends as it was (its text left out)."""
    op = OutputProcessor(ByteTokenizer(), _RecordingScheduler())
    request = Request("r", [1], SamplingParams(max_tokens=16, stop=["zz"], stop_token_ids=[ord("!")]))
    request.status = RequestStatus.RUNNING
    op.add_request(request)
    tokens = [ord(c) for c in "abc!"]
    request.output_token_ids.extend(tokens)
    request.status = RequestStatus.FINISHED_STOPPED
    request.stop_token_id = ord("!")
    (final,) = op.process(ModelRunnerOutput(["r"], [tokens]), [request])
    assert final.text == "abc" and final.token_ids == tokens and final.stop_reason == ord("!")


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_a_stop_string_completed_by_the_min_tokens_th_token_ends_there(tiny_llm_factory, offset):
    """`min_tokens` counts the token that completes a stop string: with min_tokens <= k a stop string completed
    by token k ends the sequence at k tokens; with min_tokens = k + 1 it is passed over."""
    from helpers.stop_cases import stop_completed_by_token

    llm = tiny_llm_factory()
    prompt = [11, 27, 140, 9, 33]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    k, stop = stop_completed_by_token(llm.tokenizer, free[0].token_ids)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=k + offset)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    if offset <= 0:
        assert (out.finish_reason, out.stop_reason, len(out.token_ids)) == ("stop", stop, k)
        assert out.text == llm.tokenizer.decode(free[0].token_ids[:k])[: -len(stop)]
    else:
        assert out.finish_reason == "length" and out.token_ids == free[0].token_ids
