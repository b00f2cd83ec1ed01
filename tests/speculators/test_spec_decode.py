"""Speculative decoding end to end on an HF-parity checkpoint: with greedy sampling, outputs with drafts equal
outputs without, token for token, under chunked prefill, preemption and mixed batches, with and without async
scheduling; seeded random sampling too (Gumbel noise keyed by position makes verification reproduce the
non-speculative draw exactly when drafts carry no probabilities).

Besides ngram (real proposals, mostly rejected on a random model) an *oracle* test speculator proposes the
true continuation with one token corrupted at a position that varies step to step, so every acceptance length
0..k occurs and the accept, reject and bonus paths are all exercised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch
from helpers.hf_models import SPEC_BY_NAME, VOCAB_SIZE, random_prompts, save_tiny_checkpoint

from framework.config.registry import SPECULATORS
from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from speculators import Proposal, ProposeInputs, Speculator

MAX_TOKENS = 16
K = 3
_SEGMENT = [11, 200, 37, 5, 90, 141, 66]
# Random prompts (5..40 tokens) and two built from a repeated segment (prompt lookup matches in them).
PROMPTS = random_prompts(3, 5, 40, seed=1234) + [_SEGMENT * 5, (_SEGMENT[:4] * 3 + _SEGMENT) * 2]
SCENARIOS = {
    "plain": {},
    "preempt": {"block_size": 4, "num_kv_blocks": 24},  # 24 x 4 tokens = one request of max_model_len
    "chunked": {"max_num_batched_tokens": 8},  # prefill chunks mixed with decode rows verifying drafts
    "chunked_preempt": {"block_size": 4, "num_kv_blocks": 24, "max_num_batched_tokens": 8},
}
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "llama"
    save_tiny_checkpoint(SPEC_BY_NAME["llama"], path)
    return path


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=96, seed=0, **kwargs)


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def baseline(checkpoint) -> list[list[int]]:
    return _generate(_llm(checkpoint), GREEDY)


class _Oracle(Speculator):
    """Test-only: proposes the baseline continuation of the request's history, with draft c wrong where
    c = len(history) mod (k + 1) (c = k: all right). Reads the history on the host (fine on the CPU)."""

    name = "oracle-test"
    sequences: list[list[int]] = []  # prompt + baseline output of every prompt (set by the fixture)
    with_probs = False

    def propose(self, inputs: ProposeInputs) -> Proposal:
        rs, k = inputs.request_state, inputs.num_draft_tokens
        drafts = []
        for slot in inputs.batch.idx_mapping.tolist():
            history = rs.all_token_ids[slot, : int(rs.total_len[slot])].tolist()
            full = next((s for s in self.sequences if s[: len(history)] == history), history)
            row = (full[len(history) : len(history) + k] + [0] * k)[:k]
            c = len(history) % (k + 1)
            if c < k:
                row[c] = (row[c] + 1) % VOCAB_SIZE
            drafts.append(row)
        ids = torch.tensor(drafts, dtype=torch.int32).view(-1, k)
        if not self.with_probs:
            return Proposal(ids)
        # A q that puts 0.6 on the draft and spreads the rest: probabilistic verification with q != one-hot.
        q = torch.full((ids.shape[0], k, VOCAB_SIZE), 0.4 / (VOCAB_SIZE - 1))
        q.scatter_(2, ids.long().unsqueeze(2), 0.6)
        return Proposal(ids, q)


class _OracleWithProbs(_Oracle):
    name = "oracle-probs-test"
    with_probs = True


@pytest.fixture
def oracle(baseline) -> Iterator[None]:
    _Oracle.sequences = [p + o for p, o in zip(PROMPTS, baseline)]
    for cls in (_Oracle, _OracleWithProbs):
        SPECULATORS.register(cls.name, cls, source="test")
    yield
    for cls in (_Oracle, _OracleWithProbs):
        SPECULATORS.unregister(cls.name)


@pytest.mark.parametrize(
    "scenario,async_scheduling",
    [
        ("plain", True),
        ("preempt", False),
        ("chunked", True),
        ("chunked_preempt", True),
        ("chunked_preempt", False),
    ],
)
def test_greedy_ngram_equals_no_speculation(checkpoint, baseline, scenario, async_scheduling):
    llm = _llm(checkpoint, speculative_config=NGRAM, async_scheduling=async_scheduling, **SCENARIOS[scenario])
    assert _generate(llm, GREEDY) == baseline
    metrics = llm.get_metrics()["spec_decode"]
    assert metrics["num_drafts"] > 0 and metrics["num_accepted_tokens"] > 0
    assert llm.engine.is_idle()


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_oracle_exercises_every_acceptance_length(checkpoint, baseline, oracle, async_scheduling):
    llm = _llm(
        checkpoint,
        speculative_config={"method": "oracle-test", "num_speculative_tokens": K},
        async_scheduling=async_scheduling,
        **SCENARIOS["chunked_preempt"],
    )
    seen: list[tuple[int, int]] = []
    record = llm.engine.spec_metrics.record_step
    llm.engine.spec_metrics.record_step = lambda d, a: (seen.extend(zip(d, a)), record(d, a))  # type: ignore
    assert _generate(llm, GREEDY) == baseline
    assert {a for d, a in seen if d == K} == set(range(K + 1))  # rejected at 0, 1, 2, and all accepted
    metrics = llm.get_metrics()["spec_decode"]
    assert 1.5 < metrics["mean_acceptance_length"] < K + 1
    assert metrics["per_position_acceptance"] == sorted(metrics["per_position_acceptance"], reverse=True)


def test_dynamic_k_wrapping_ngram_equals_no_speculation(checkpoint, baseline):
    spec = {**NGRAM, "dynamic_k": True}
    llm = _llm(checkpoint, speculative_config=spec)
    llm.engine.draft_policy.decisions = []  # the engine's policy keeps no log (a server runs for ever): record here
    assert _generate(llm, GREEDY) == baseline
    assert len(set(llm.engine.draft_policy.history)) > 1  # it explored several k (0 included)


def test_dynamic_k_measures_only_steady_decode_steps(checkpoint):
    """Step costs reach the policy only from pure decode steps with as many rows as the step before and no
    request finished at the previous output: a draining batch (requests of different lengths) would charge
    its host work and shape changes to whatever k it ran at."""
    spec = {**NGRAM, "dynamic_k": True}
    llm = _llm(checkpoint, speculative_config=spec)
    scheduler, policy = llm.engine.scheduler, llm.engine.draft_policy
    events: list[tuple] = []  # ("obs", rows) comes just before the ("out", rows, finished) of the same output
    observe, update = policy.observe_step, scheduler.update_from_output
    policy.observe_step = lambda rows, k, s: (events.append(("obs", rows)), observe(rows, k, s))  # type: ignore
    scheduler.update_from_output = lambda out, *a: (
        lambda f: (
            events.append(  # type: ignore[method-assign]
                ("out", len(out.scheduled_request_ids), len(f))
            ),
            f,
        )[1]
    )(update(out, *a))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 9, 14, 30, 30)]
    llm.generate(PROMPTS, params, use_tqdm=False)
    observed = [i for i, e in enumerate(events) if e[0] == "obs"]
    assert len(observed) >= 5
    for i in observed:
        this, before = events[i + 1], events[i - 1]
        assert this[0] == before[0] == "out" and this[1] == before[1] == events[i][1]  # same rows
        assert before[2] == 0  # nothing finished at the previous output
    drained = [e for e in events if e[0] == "out" and e[2]]
    assert len(drained) >= 3  # requests did finish at different steps (the filter had work to do)


SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_seeded_sampling_with_drafts_equals_without(checkpoint, oracle):
    want = _generate(_llm(checkpoint), SEEDED)
    _Oracle.sequences = [p + o for p, o in zip(PROMPTS, want)]  # propose the seeded continuation (corrupted)
    oracle_llm = _llm(checkpoint, speculative_config={"method": "oracle-test", "num_speculative_tokens": K})
    assert _generate(oracle_llm, SEEDED) == want
    assert oracle_llm.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0


def test_draft_probabilities_are_verified_deterministically(checkpoint, baseline, oracle):
    """Repeatable and greedy-exact; that the verified tokens follow the target distribution is checked by
    tests/speculators/test_spec_probs_distribution.py (whose negative control accepts every draft)."""
    spec = {"method": "oracle-probs-test", "num_speculative_tokens": K}
    first = _llm(checkpoint, speculative_config=spec)
    out = _generate(first, SEEDED)
    assert _generate(_llm(checkpoint, speculative_config=spec, async_scheduling=False), SEEDED) == out
    assert all(len(o) == MAX_TOKENS for o in out)
    assert first.get_metrics()["spec_decode"]["num_accepted_tokens"] > 0
    # Greedy rows ignore q: they accept exactly the drafts that equal the argmax.
    assert _generate(first, GREEDY) == baseline


def test_logprobs_and_penalties_with_drafts(checkpoint, baseline):
    llm = _llm(checkpoint, speculative_config=NGRAM)
    outs = llm.generate(
        PROMPTS[-2:],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )
    for o, want in zip(outs, baseline[-2:]):
        assert o.token_ids == want
        assert len(o.logprobs) == len(o.token_ids)
        assert all(tok in entry for tok, entry in zip(o.token_ids, o.logprobs))
    penalised = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3)
    want = [o.token_ids for o in _llm(checkpoint).generate(PROMPTS[-1:], penalised, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(PROMPTS[-1:], penalised, use_tqdm=False)] == want
