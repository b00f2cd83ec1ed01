"""An error raised inside a step because of one request's values ends that request only, on both runners: when an
owner refuses the request as it joins (V1's owners), and when the step's batched apply of staged writes fails on
the values one slot staged (V2 through a custom logits processor, V1 through its sampling table). The neighbour
keeps running and its tokens are those it gets alone."""

from __future__ import annotations

import pytest
import torch

from framework import SamplingParams
from framework.batch.staged_writes import StagedWrites
from framework.config.registry import LOGITS_PROCESSORS
from framework.params.request_errors import SlotWriteError
from samplers.logits_processors import LogitsProcessor

GOOD = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
BAD = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"scale": 2**70})


class StagesAScale(LogitsProcessor):
    """Stages each request's extra_args["scale"] into an int64 table, applied once per step with every other
    slot's: a value the table cannot hold fails that batched apply."""

    def __init__(self, max_num_reqs, vocab_size, device):
        super().__init__(max_num_reqs, vocab_size, device)
        self.scale = torch.zeros(max_num_reqs, dtype=torch.int64, device=device)
        self._staged = StagedWrites(self.scale)

    def add_request(self, req_slot, params):
        self._staged.stage(req_slot, (params.extra_args or {}).get("scale", 0))

    def apply_staged_writes(self):
        self._staged.apply()

    def is_active(self, req_slots):
        return False

    def apply(self, logits, context):
        return logits


def _serve(engine, first, second) -> dict:
    engine.add_request("good", [5, 6, 7, 8], first)
    engine.step()  # the good request is running when the bad one arrives
    engine.add_request("bad", [9, 6, 7], second)
    finished = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            return finished
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    raise AssertionError("requests hang")


def _check(finished, alone, message):
    assert finished["bad"].finish_reason == "error" and message in finished["bad"].error
    assert "'bad'" in finished["bad"].error
    assert finished["good"].finish_reason == "length" and finished["good"].error is None
    assert finished["good"].token_ids == alone


def test_v2_batched_apply_failure_ends_that_request_only(tiny_llm_factory, leak_check):
    LOGITS_PROCESSORS.register("test_stages_a_scale", StagesAScale)
    try:
        llm = tiny_llm_factory(logits_processors=["test_stages_a_scale"])
        finished = _serve(llm.engine, GOOD, BAD)
        alone = tiny_llm_factory().generate([[5, 6, 7, 8]], GOOD, use_tqdm=False)[0].token_ids
        _check(finished, alone, "OverflowError")
        assert not llm.engine.failures.dead and llm.engine.failures.consecutive_failures == 0
        leak_check.engine(llm.engine)
    finally:
        LOGITS_PROCESSORS.unregister("test_stages_a_scale")


@pytest.mark.parametrize("where", ["add_request", "batched_apply"])
def test_v1_step_error_of_one_request_ends_that_request_only(tiny_llm_factory, where):
    llm = tiny_llm_factory(runner="v1")
    runner = llm.engine.runner
    table = runner.sampling_params
    original = table.add_request

    def add_request(slot, params, seed):  # a value of the request that only the step finds wrong
        original(slot, params, seed)
        scale = (params.extra_args or {}).get("scale")
        if scale is not None and where == "add_request":
            raise ValueError("this table cannot take that request")
        if scale is not None:
            table._staged["seed"].stage(slot, scale)

    table.add_request = add_request
    finished = _serve(llm.engine, GOOD, BAD)
    alone = tiny_llm_factory(runner="v1").generate([[5, 6, 7, 8]], GOOD, use_tqdm=False)[0].token_ids
    _check(finished, alone, "cannot take that request" if where == "add_request" else "OverflowError")
    assert llm.engine.failures.consecutive_failures == 0


def test_staged_writes_name_the_slot_whose_values_fail():
    staged = StagedWrites(torch.zeros(4, dtype=torch.int64))
    staged.stage(0, 3)
    staged.stage(2, 2**70)
    with pytest.raises(SlotWriteError) as err:
        staged.apply()
    assert err.value.req_slot == 2 and isinstance(err.value.cause, OverflowError)
    staged.stage(1, 5)  # the failed writes were dropped: the next apply writes only its own
    staged.apply()
    assert staged.target.tolist() == [0, 5, 0, 0]
