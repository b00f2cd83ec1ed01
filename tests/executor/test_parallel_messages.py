"""The driver's commands travel as typed msgpack (framework.executor.messages): a round trip keeps every field,
and a crafted payload (a pickle that would run code, a command of the wrong shape) is refused without running."""

from __future__ import annotations

import os
import pickle

import msgspec
import pytest
import torch

from framework.executor.messages import Command, CommandDecodeError, decode_command, encode_command
from framework.params.encoder_input import EncoderInput
from framework.params.pooling_params import PoolingParams
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput, StateSnapshot

RAN: list[str] = []


def _mark(note: str) -> None:
    RAN.append(note)


class _Exploit:
    """Unpickling this calls `_mark` (a stand-in for `os.system`)."""

    def __reduce__(self):
        return (_mark, ("code ran",))


def _step() -> SchedulerOutput:
    params = SamplingParams(
        temperature=0.7,
        top_k=5,
        seed=3,
        logit_bias={7: -1.5},
        bad_words=["ab"],
        stop=["\n"],
        extra_args={"my_processor": {"weight": 0.5, "ids": [1, 2]}},
    )
    params._bad_words_token_ids = [[4, 5]]  # resolved by the driver's engine; workers' samplers need it
    features = torch.arange(12, dtype=torch.float32).reshape(3, 4).to(torch.bfloat16)
    new = [
        NewRequestData("gen", [1, 2, 3], 2, params, 11, [0, 1], 0, snapshot_slot=4),
        NewRequestData("emb", [9, 8], 2, SamplingParams(), 12, [2], 0, pooling_params=PoolingParams("mean", False, 8)),
        NewRequestData("asr", [5], 1, SamplingParams(), 13, [3], 0, encoder_input=EncoderInput(features, 3)),
    ]
    return SchedulerOutput(
        ["gen", "emb", "asr", "old"],
        [3, 2, 1, 2],
        [0, 0, 0, 1],
        new,
        [CachedRequestData("old", [6])],
        {"done"},
        2,
        [0, 0, 0, 9],
        [StateSnapshot(0, 2, 4)],
    )


def test_a_step_command_round_trips_every_field():
    sent = _step()
    got = decode_command(encode_command(Command("step", sent))).payload
    assert isinstance(got, SchedulerOutput) and got.finished_request_ids == {"done"}
    features = got.new_requests[2].encoder_input.features
    assert features.dtype == torch.bfloat16 and torch.equal(features, sent.new_requests[2].encoder_input.features)
    for mine, theirs in zip(got.new_requests, sent.new_requests):
        assert mine.sampling_params == theirs.sampling_params and mine.pooling_params == theirs.pooling_params
    assert got.new_requests[0].sampling_params._bad_words_token_ids == [[4, 5]]
    assert got.new_requests[0].sampling_params.logit_bias == {7: -1.5}  # int keys stay ints
    strip = [NewRequestData(**{**r.__dict__, "encoder_input": None}) for r in got.new_requests]
    sent_strip = [NewRequestData(**{**r.__dict__, "encoder_input": None}) for r in sent.new_requests]
    assert strip == sent_strip and got.cached_requests == sent.cached_requests
    assert (
        got.scheduled_request_ids,
        got.num_scheduled_tokens,
        got.num_draft_tokens,
        got.num_propose_tokens,
        got.num_computed_tokens,
        got.state_snapshots,
    ) == (
        sent.scheduled_request_ids,
        sent.num_scheduled_tokens,
        sent.num_draft_tokens,
        2,
        [0, 0, 0, 9],
        sent.state_snapshots,
    )
    assert decode_command(encode_command(Command("init_kv", 17))) == Command("init_kv", 17)
    assert decode_command(encode_command(Command("shutdown"))) == Command("shutdown")


def test_a_pickled_payload_is_refused_and_runs_nothing():
    payload = pickle.dumps(_Exploit())
    assert pickle.loads(payload) is None and RAN == ["code ran"]  # the control: unpickling it does run code
    RAN.clear()
    with pytest.raises(CommandDecodeError, match="not a valid driver command"):
        decode_command(payload)
    assert RAN == []


@pytest.mark.parametrize(
    "crafted, why",
    [
        ({"kind": "exec", "payload": None}, "exec"),
        ({"kind": "step", "payload": 3}, "expected SchedulerOutput"),
        ({"kind": "init_kv", "payload": True}, "got `bool`"),
        ({"kind": "step", "payload": {"scheduled_request_ids": "rm -rf"}}, "scheduled_request_ids"),
        ({"kind": "shutdown", "payload": {"__reduce__": [os.system.__name__, ["id"]]}}, "missing required field"),
        ({"kind": "graphs", "payload": 5}, "expected nothing"),
    ],
)
def test_a_command_of_the_wrong_shape_is_refused_with_the_reason(crafted, why):
    with pytest.raises(CommandDecodeError, match=why):
        decode_command(msgspec.msgpack.encode(crafted))


def test_a_tensor_payload_is_checked_before_it_is_built():
    step = msgspec.to_builtins(Command("step", _step()), enc_hook=lambda t: None)  # tensor -> None, patched below
    features = step["payload"]["new_requests"][2]
    for wire, why in (
        [["float32", [2, 2], b"\0" * 15], "needs 16 bytes"],
        [["object", [1], b"\0"], "not allowed"],
        [["float32", [-1], b""], "negative"],
    ):
        features["encoder_input"] = {"features": wire, "num_encoder_tokens": 3}
        with pytest.raises(CommandDecodeError, match=why):
            decode_command(msgspec.msgpack.encode(step))
    with pytest.raises(TypeError, match="cannot carry a complex64 tensor"):
        encode_command(
            Command(
                "step",
                SchedulerOutput(
                    ["a"],
                    [1],
                    [0],
                    [
                        NewRequestData(
                            "a",
                            [1],
                            1,
                            SamplingParams(),
                            1,
                            [0],
                            0,
                            encoder_input=EncoderInput(torch.zeros(1, dtype=torch.complex64), 1),
                        )
                    ],
                    [],
                ),
            )
        )
