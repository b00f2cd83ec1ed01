"""The server's parts without a server: the wire protocol, parallel sampling, chat templates, stop strings."""

from __future__ import annotations

import os
import pickle
import tempfile

import msgspec
import pytest

from framework import LLM, SamplingParams
from framework.engine.parallel_sampling import child_seed, fan_out
from framework.entrypoints.chat_template import ChatTemplate
from framework.entrypoints.serve.protocol import (
    AddRequest,
    EngineOutputs,
    EngineStats,
    SequenceDelta,
    engine_codec,
    front_end_codec,
)
from framework.entrypoints.serve.sequence_text import SequenceText
from framework.models.tokenizer import ByteTokenizer
from framework.params.sampling_params import InvalidRequestError


class _Boom:
    def __reduce__(self):  # what a pickle-based protocol would execute on load
        return (os.system, (f"touch {MARKER}",))


MARKER = os.path.join(tempfile.gettempdir(), "mrv2-protocol-pwned")


def test_protocol_round_trip_and_refuses_crafted_payloads():
    front, engine = front_end_codec(), engine_codec()
    message = AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0.5, n=2, logit_bias={7: 1.5}, stop=["\n"]))
    assert engine.decode(front.encode(message)) == message
    stats = EngineStats(1, 2, 10, 8, 5, 3, 0, 0, 0)
    out = EngineOutputs([SequenceDelta("r1", 1, [4, 5], "length", logprobs=[[(4, -0.1, 1)], [(5, -0.2, 1)]])], stats)
    assert front.decode(engine.encode(out)) == out
    if os.path.exists(MARKER):
        os.remove(MARKER)
    for payload in (
        pickle.dumps(_Boom()),
        msgspec.msgpack.encode({"type": "add", "request_id": 1}),
        msgspec.msgpack.encode({"type": "exec", "code": "import os"}),
    ):
        with pytest.raises(msgspec.DecodeError):
            engine.decode(payload)
    assert not os.path.exists(MARKER)
    bad_range = msgspec.msgpack.encode(
        {"type": "add", "request_id": "a", "prompt_token_ids": [1], "sampling_params": {"top_p": 7}}
    )
    with pytest.raises(msgspec.ValidationError, match="top_p"):  # SamplingParams validates on decode too
        engine.decode(bad_range)


def test_fan_out_seeds_and_ids():
    assert fan_out("a", SamplingParams()) == [("a", SamplingParams())]
    kids = fan_out("a", SamplingParams(n=3, seed=5))
    assert [k for k, _ in kids] == ["a#0", "a#1", "a#2"]
    seeds = [p.seed for _, p in kids]
    assert seeds[0] == 5 and len(set(seeds)) == 3 and all(p.n == 1 for _, p in kids)
    assert child_seed(5, 1) != child_seed(6, 1) and child_seed(5, 1) != child_seed(5, 2)
    assert [p.seed for _, p in fan_out("b", SamplingParams(n=2))] == [None, None]
    with pytest.raises(InvalidRequestError, match="SamplingParams.n"):
        SamplingParams(n=0)


def test_offline_n_shares_prompt_blocks_and_abort_frees_every_sequence():
    llm = LLM("tiny", device="cpu", block_size=4)
    prompt = "def longest_common_prefix(strings):\n    "
    out = llm.generate([prompt], SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3] and out.text == out.outputs[0].text
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    alone = llm.generate([prompt], SamplingParams(temperature=1.0, seed=11, max_tokens=8), use_tqdm=False)[0]
    assert alone.token_ids == out.outputs[0].token_ids
    num_prompt = len(llm.tokenizer.encode(prompt))
    stats = llm.prefix_cache_stats  # sequences 1..3 (and the n=1 rerun) hit the blocks sequence 0 published
    assert stats.hits >= 4 * ((num_prompt - 1) // 4) * 4
    llm.engine.add_request("p", llm.tokenizer.encode(prompt), SamplingParams(n=3, max_tokens=50))
    llm.engine.step()
    assert llm.engine.abort_request("p") is not None
    assert llm.engine.abort_request("p") is None
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert llm.engine.is_idle() and not llm.engine.parallel_sampling
    streamed = {}
    for o in llm.generate_stream([prompt], SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=8)):
        streamed[o.index] = streamed.get(o.index, "") + o.text
    assert streamed == {0: out.outputs[0].text, 1: out.outputs[1].text}


def test_chat_template_renders_in_a_sandbox():
    t = ChatTemplate(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert t.render(msgs) == "<user>a\nb<assistant>"  # text parts joined by newlines, as vLLM does
    assert (
        t.render(
            [*msgs, {"role": "assistant", "content": "x"}], add_generation_prompt=False, continue_final_message=True
        )
        == "<user>a\nb<assistant>x"
    )
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        evil.render(msgs)
    with pytest.raises(InvalidRequestError, match="role"):
        t.render([{"role": "wizard", "content": "x"}])
    with pytest.raises(InvalidRequestError, match="image"):
        t.render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(InvalidRequestError, match="refused"):
        ChatTemplate("{{ raise_exception('no system role') }}").render(msgs)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        ChatTemplate.from_model_dir(None)
    with pytest.raises(InvalidRequestError, match="no chat template"):
        LLM("random_tiny", device="cpu", max_model_len=64).chat(msgs)


def test_continue_final_message_under_a_template_that_trims():
    """Templates often trim content (Llama 3's `| trim`): the prefill is found stripped and continued, as
    transformers' apply_chat_template does, not refused because its trailing space or newline is gone."""
    t = ChatTemplate(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "```json\n"}]
    assert t.render(msgs, add_generation_prompt=False, continue_final_message=True) == "<user>hi</s><assistant>```json"
    keeps = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}")
    assert (
        keeps.render([{"role": "user", "content": " a b "}], add_generation_prompt=False, continue_final_message=True)
        == "<user> a b "
    )  # spacing the template keeps is kept
    with pytest.raises(InvalidRequestError, match="does not contain the final message"):
        ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}").render(
            msgs, add_generation_prompt=False, continue_final_message=True
        )


def test_sequence_text_stops_and_holds_back():
    tok = ByteTokenizer()
    params = SamplingParams(stop=["END"], max_tokens=50)
    seq = SequenceText(tok, params, incremental=True)
    released = []
    for ch in "abcEN":
        assert not seq.add([ord(ch)], None)
        released.append(seq.release(final=False))
    assert "".join(released) == "abc"  # "EN" may be the start of "END"
    assert seq.add([ord("D"), ord("x")], None) and seq.stop_string == "END"
    assert seq.token_ids == [ord(c) for c in "abcEND"]  # tokens after the stop are dropped
    assert seq.release(final=True) == ""
    keep = SequenceText(tok, SamplingParams(stop=["EN"], include_stop_str_in_output=True, min_tokens=4), True)
    assert not keep.add([ord(c) for c in "ENx"], None)  # min_tokens: no stop before 4 tokens
    assert keep.add([ord(c) for c in "EN"], None) and keep.text == "ENxEN"
    once = SequenceText(tok, SamplingParams(max_tokens=5), incremental=False)
    once.add([104, 105], None)
    assert once.text == ""  # no stop strings, not streamed: decoded once at the end
    once.finish()
    assert once.release(final=True) == "hi"


def test_an_unexpected_error_is_an_openai_shaped_500():
    """A handler that fails unexpectedly (a bug) still answers with an OpenAI error body, not plain text."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from framework.entrypoints.serve.app import build_app

    serve = SimpleNamespace(api_key=None, max_request_bytes=1 << 20)
    app = build_app(SimpleNamespace(config=SimpleNamespace(serve=serve), client=SimpleNamespace(dead=None)))

    @app.get("/v1/boom")
    async def boom() -> None:
        raise RuntimeError("kaput")

    with TestClient(app, raise_server_exceptions=False) as http:
        r = http.get("/v1/boom")
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert r.json()["error"]["message"] == "internal error (RuntimeError): kaput"
        assert http.get("/version").status_code == 200


def test_loggable_escapes_client_text():
    from framework.entrypoints.serve.errors import loggable

    assert loggable("a\nb\x1b[31m\u2028é") == "'a\\nb\\x1b[31m\\u2028\\xe9'"
    assert loggable("x" * 300, limit=5) == "'xxxxx'..."
