"""Custom logits processors in the engine: one registered by name applies to its own requests only, and an unknown
name is a configuration error."""

from __future__ import annotations

import pytest
import torch
from test_sampler_engine import _prompt

from framework import InvalidRequestError, SamplingParams
from framework.config.registry import LOGITS_PROCESSORS
from samplers.logits_processors import LogitsProcessor


class ForceToken(LogitsProcessor):
    """Test processor: a request with extra_args={"force": t} can only sample t."""

    def __init__(self, max_num_reqs, vocab_size, device):
        super().__init__(max_num_reqs, vocab_size, device)
        self.forced = torch.full((max_num_reqs,), -1, dtype=torch.int64, device=device)
        self.host = [-1] * max_num_reqs

    @classmethod
    def validate_params(cls, params, vocab_size):
        force = (params.extra_args or {}).get("force")
        if force is not None and not (isinstance(force, int) and 0 <= force < vocab_size):
            raise InvalidRequestError(f"extra_args['force']={force!r} is not a token id")

    def add_request(self, req_slot, params):
        self.host[req_slot] = (params.extra_args or {}).get("force", -1)

    def apply_staged_writes(self):
        self.forced.copy_(torch.tensor(self.host))

    def is_active(self, req_slots):
        return any(self.host[s] >= 0 for s in req_slots)

    def apply(self, logits, context):
        forced = self.forced[context.expanded_idx_mapping.long()]  # [L]
        keep = torch.arange(logits.shape[1], device=logits.device) == forced.unsqueeze(1)
        return torch.where((forced >= 0).unsqueeze(1) & ~keep, float("-inf"), logits)


@pytest.fixture
def force_token_registered():
    LOGITS_PROCESSORS.register("test_force_token", ForceToken)
    yield "test_force_token"
    LOGITS_PROCESSORS.unregister("test_force_token")


def test_custom_logits_processor_from_the_registry(tiny_llm_factory, force_token_registered):
    llm = tiny_llm_factory(logits_processors=[force_token_registered])
    params = [
        SamplingParams(temperature=1.0, seed=1, max_tokens=5, ignore_eos=True, extra_args={"force": 42}),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate([_prompt(5, 40), _prompt(5, 41)], params, use_tqdm=False)
    assert outs[0].token_ids == [42] * 5
    alone = tiny_llm_factory().generate([_prompt(5, 41)], params[1], use_tqdm=False)[0]
    assert outs[1].token_ids == alone.token_ids  # the other request is untouched
    with pytest.raises(InvalidRequestError, match="extra_args"):
        llm.generate([[1]], SamplingParams(extra_args={"force": 999}), use_tqdm=False)


def test_unknown_logits_processor_is_a_config_error(tiny_llm_factory):
    from framework import ConfigError

    with pytest.raises(ConfigError, match="sampler.logits_processors: unknown logits processor 'nope'"):
        tiny_llm_factory(logits_processors=["nope"])


class BreaksOnAdd(ForceToken):
    """A processor whose own host-side code fails on one request's value (extra_args={"break": True}), past
    what its `validate_params` checks: a bug of one request's values, raised inside a step."""

    def add_request(self, req_slot, params):
        if (params.extra_args or {}).get("break"):
            raise ValueError("this processor cannot take that request")
        super().add_request(req_slot, params)


def test_an_error_raised_in_a_step_by_one_request_ends_that_request_only(tiny_llm_factory, leak_check):
    LOGITS_PROCESSORS.register("test_breaks_on_add", BreaksOnAdd)
    try:
        llm = tiny_llm_factory(logits_processors=["test_breaks_on_add"])
        good = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        bad = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, extra_args={"break": True})
        engine = llm.engine
        engine.add_request("good", _prompt(5, 41), good)
        engine.step()  # the good request is running when the bad one arrives
        engine.add_request("bad", _prompt(5, 40), bad)
        finished = {}
        while engine.has_unfinished_requests():
            finished.update({o.request_id: o for o in engine.step() if o.finished})
        assert finished["bad"].finish_reason == "error" and "cannot take that request" in finished["bad"].error
        assert "'bad'" in finished["bad"].error
        assert finished["good"].finish_reason == "length" and finished["good"].error is None
        alone = tiny_llm_factory().generate([_prompt(5, 41)], good, use_tqdm=False)[0]
        assert finished["good"].token_ids == alone.token_ids
        assert not engine.failures.dead and engine.failures.consecutive_failures == 0
        leak_check.engine(engine)
    finally:
        LOGITS_PROCESSORS.unregister("test_breaks_on_add")
