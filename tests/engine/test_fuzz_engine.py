"""Property-based fuzzing of EngineCore and a seeded soak: random arrivals, aborts, lengths and sampling
parameters on a KV cache small enough to preempt, for both runners and both scheduling modes.

Invariants after every step: each request ends exactly once; the block pool is conserved and only running
requests hold blocks (`scheduler.check_invariants`); once all ended, every block and runner slot is free; a
greedy request's tokens equal its tokens when run alone; the engine keeps serving the other requests.
Hypothesis runs derandomized with a bounded number of examples, so CI time and results are fixed.
"""

from __future__ import annotations

import random

import pytest
from helpers.leak_check import assert_engine_drained
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from framework import LLM, SamplingParams, load_config

SMALL = {
    "cache": {"block_size": 4, "num_blocks": 16, "enable_prefix_caching": True},
    "model": {"preset": "random_tiny", "max_model_len": 64},
    "scheduler": {"max_num_batched_tokens": 16, "max_num_seqs": 4, "check_invariants": True},
}
MAX_STEPS = 3000  # a request that has not ended by then hangs
_engines: dict = {}
_alone: dict = {}
FIGURES = {"schedules": 0, "requests": 0, "steps": 0, "preemptions": 0, "lost": 0, "prefix_cache_hits": 0}
_hits_seen: dict[int, int] = {}  # prefix-cache hits of each engine counted so far
# Half the prompts start with part of this one, so requests share prefixes (prefix-cache hits and evictions).
SHARED_PREFIX = tuple(random.Random(99).randrange(320) for _ in range(24))


def _engine(runner: str, async_scheduling: bool):
    key = (runner, async_scheduling)
    if key not in _engines:
        cfg = {
            **SMALL,
            "device": "cpu",
            "runner": {"kind": runner},
            "scheduler": {**SMALL["scheduler"], "async_scheduling": async_scheduling},
        }
        _engines[key] = LLM(config=load_config(cfg)).engine
    return _engines[key]


def _greedy_alone(runner: str, prompt: tuple, max_tokens: int) -> list[int]:
    key = (runner, prompt, max_tokens)
    if key not in _alone:
        if ("ref", runner) not in _engines:
            _engines[("ref", runner)] = LLM("random_tiny", device="cpu", runner=runner, max_model_len=64)
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        _alone[key] = _engines[("ref", runner)].generate([list(prompt)], params, use_tqdm=False)[0].token_ids
    return _alone[key]


def _params(rng: random.Random, greedy: bool, max_tokens: int, full: bool) -> SamplingParams:
    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    extra = {}
    if full:  # V2 only: penalties and logprobs
        extra = dict(
            presence_penalty=rng.choice([0.0, 0.5]),
            repetition_penalty=rng.choice([1.0, 1.2]),
            logprobs=rng.choice([None, 0, 3]),
            min_tokens=rng.choice([0, 1]),
        )
    return SamplingParams(
        temperature=rng.choice([0.5, 1.0]),
        top_k=rng.choice([0, 5]),
        top_p=rng.choice([1.0, 0.8]),
        min_p=rng.choice([0.0, 0.1]),
        seed=rng.randrange(1000),
        max_tokens=max_tokens,
        ignore_eos=rng.random() < 0.7,
        **extra,
    )


def drive(engine, runner: str, ops: list, seed: int) -> int:
    """Run a schedule of ("add", prompt_len, max_tokens, greedy) / ("abort", k) / ("steps", n) ops, then drain.
    Checks the invariants after every step; returns the number of steps."""
    rng = random.Random(seed)
    sent, ended, greedy, steps = [], {}, {}, 0
    base = f"s{FIGURES['schedules']}-"

    def step():
        nonlocal steps
        steps += 1
        for out in engine.step():  # check_invariants runs inside the step
            assert out.request_id in sent and out.request_id not in ended, f"{out.request_id} ended twice"
            if out.finished:
                ended[out.request_id] = out

    for op in ops:
        if op[0] == "add":
            _, n, max_tokens, is_greedy = op
            rid = f"{base}{len(sent)}"
            prompt = tuple(rng.randrange(320) for _ in range(n))
            if rng.random() < 0.5:
                shared = rng.randint(1, min(n, len(SHARED_PREFIX)))
                prompt = SHARED_PREFIX[:shared] + prompt[shared:]
            engine.add_request(rid, list(prompt), _params(rng, is_greedy, max_tokens, runner == "v2"))
            sent.append(rid)
            if is_greedy:
                greedy[rid] = (prompt, max_tokens)
        elif op[0] == "abort" and sent:
            rid = sent[op[1] % len(sent)]
            out = engine.abort_request(rid)
            if rid in ended:
                assert out is None  # already ended: nothing happens
            else:
                assert out is not None and out.finish_reason == "abort"
                ended[rid] = out
        else:
            for _ in range(op[1]):
                step()
    while engine.has_unfinished_requests():
        assert steps < MAX_STEPS, "requests hang"
        step()
    assert sorted(ended) == sorted(sent), "a request was lost"  # each ended exactly once (checked in step)
    for rid, (prompt, max_tokens) in greedy.items():
        if ended[rid].finish_reason != "abort":
            assert ended[rid].finish_reason == "length"
            assert ended[rid].token_ids == _greedy_alone(runner, prompt, max_tokens)
    hits = engine.prefix_cache_stats.hits
    FIGURES["prefix_cache_hits"] += hits - _hits_seen.get(id(engine), 0)
    _hits_seen[id(engine)] = hits
    assert_engine_drained(engine)
    FIGURES["schedules"] += 1
    FIGURES["requests"] += len(sent)
    FIGURES["steps"] += steps
    FIGURES["preemptions"] += sum(o.num_preemptions for o in ended.values())
    return steps


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 20), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("steps"), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=14,
)


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_fuzzed_schedules_lose_nothing(runner, async_scheduling, one_thread):
    engine = _engine(runner, async_scheduling)

    @settings(
        max_examples=25,
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(ops=OPS, seed=st.integers(0, 2**16))
    def run(ops, seed):
        drive(engine, runner, ops, seed)

    run()


def test_soak(one_thread):
    """A few thousand steps of seeded random traffic on one engine, preempting, with aborts."""
    rng = random.Random(2026)
    engine = _engine("v2", True)
    total = 0
    while total < 3000:
        ops = []
        for _ in range(rng.randint(4, 16)):
            kind = rng.random()
            if kind < 0.5:
                ops.append(("add", rng.randint(1, 40), rng.randint(1, 20), rng.random() < 0.3))
            elif kind < 0.6:
                ops.append(("abort", rng.randrange(50)))
            else:
                ops.append(("steps", rng.randint(1, 8)))
        total += drive(engine, "v2", ops, rng.randrange(1 << 30))
    assert total >= 3000 and FIGURES["preemptions"] > 0 and FIGURES["prefix_cache_hits"] > 0
    print(f"\nreliability figures: {FIGURES}")


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_faults_under_preemption_leak_nothing(runner, async_scheduling, one_thread):
    """The runner raises every few steps while requests finish, get preempted and resume: every request still
    ends exactly once, and no block or slot leaks (a failed step's releases must still reach the runner)."""
    cfg = {
        **SMALL,
        "device": "cpu",
        "runner": {"kind": runner},
        "scheduler": {**SMALL["scheduler"], "async_scheduling": async_scheduling},
    }
    engine = LLM(config=load_config(cfg)).engine
    original, calls = engine.runner.execute_model, {"n": 0}

    def flaky(output):
        calls["n"] += 1
        if calls["n"] % 7 == 0:
            raise RuntimeError("injected fault")
        return original(output)

    engine.runner.execute_model = flaky
    rng = random.Random(7)
    sent, ended = [], {}
    for i in range(30):
        sent.append(f"f{i}")
        engine.add_request(
            sent[-1],
            [rng.randrange(320) for _ in range(rng.randint(1, 40))],
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 20), ignore_eos=True),
        )
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                assert out.request_id not in ended
                ended[out.request_id] = out
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.request_id not in ended
            ended[out.request_id] = out
    assert sorted(ended) == sorted(sent)
    assert {o.finish_reason for o in ended.values()} == {"length", "error"}
    engine.runner.execute_model = original
    assert_engine_drained(engine)
