"""Reliability: the catalogue of bad inputs, faults injected into the runner and at start-up, NaN isolation."""

from __future__ import annotations

import gc
import json
import re
import types
import weakref
from pathlib import Path

import pytest
import torch
from helpers.leak_check import assert_engine_drained
from helpers.reliability_catalogue import CASES, markdown_table

from framework import LLM, EngineDeadError, SamplingParams
from framework.engine.failure import MAX_CONSECUTIVE_STEP_FAILURES

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
OK_PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A valid HF-style directory holding the tiny preset (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from framework.models.loader import build_model, init_random_weights
    from framework.models.presets import preset_config

    cfg = preset_config("random_tiny")
    model = build_model(cfg, torch.float32, torch.device("cpu"))
    init_random_weights(model, 0, cfg["initializer_range"])  # the preset's weights, as LLM("random_tiny")
    root = tmp_path_factory.mktemp("tiny-ckpt")
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        if t.data_ptr() not in seen:  # tied weights are stored once
            seen.add(t.data_ptr())
            tensors[name] = t.contiguous()
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def alone_reference() -> list[list[int]]:
    """Each of OK_PROMPTS' greedy tokens run alone: what the requests in flight must give whatever happens."""
    llm = LLM("random_tiny", device="cpu")
    return [llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids for prompt in OK_PROMPTS]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return alone_reference()


@pytest.fixture(scope="module")
def running_llm() -> LLM:
    return LLM("random_tiny", device="cpu")


def test_checkpoint_fixture_loads(checkpoint):
    assert LLM(str(checkpoint), device="cpu").generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_catalogue_case(case, checkpoint, running_llm, reference, tmp_path, one_thread):
    ctx = types.SimpleNamespace(llm=running_llm, ckpt=checkpoint, tmp=tmp_path)
    engine = running_llm.engine
    if case.engine_running:
        for i, prompt in enumerate(OK_PROMPTS):
            engine.add_request(f"ok-{i}", prompt, GREEDY)
        engine.step()
        engine.step()
    if case.error is None:
        assert case.trigger(ctx) is None
    else:
        with pytest.raises(case.error, match=re.escape(case.message)):
            case.trigger(ctx)
    if case.engine_running:  # the requests in flight finish as if nothing had happened
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert [done[f"ok-{i}"].token_ids for i in range(len(OK_PROMPTS))] == reference
        assert sorted(done) == [f"ok-{i}" for i in range(len(OK_PROMPTS))]  # the bad request was never queued
        assert_engine_drained(engine)


def test_docs_table_lists_the_catalogue():
    text = DOC.read_text()
    start, end = "<!-- catalogue:start -->\n", "\n<!-- catalogue:end -->"
    table = text[text.index(start) + len(start) : text.index(end)]
    assert table == markdown_table(), "docs/reliability.md is stale: paste tests/reliability_catalogue.markdown_table()"


# ---- faults injected into the runner ----------------------------------------------------------------------
def _inject(runner, method: str, fail_on_calls: set[int]):
    """Make runner.<method> raise on the given call numbers (1-based)."""
    original, calls = getattr(runner, method), {"n": 0}

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in fail_on_calls:
            raise RuntimeError(f"injected fault in {method}")
        return original(*args, **kwargs)

    setattr(runner, method, wrapped)
    return calls


def _run(engine, max_steps: int = 500) -> dict:
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            assert out.request_id not in done, "a request ended twice"
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("requests hang")


@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("method", ["execute_model", "sample_tokens"])
def test_step_fault_errors_the_running_requests_and_the_engine_serves_on(runner, async_scheduling, method, one_thread):
    llm = LLM("random_tiny", device="cpu", runner=runner, async_scheduling=async_scheduling, max_num_seqs=2)
    engine = llm.engine
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 6, 7], GREEDY)
    _inject(engine.runner, method, {3})
    done = _run(engine)
    assert sorted(done) == ["r0", "r1", "r2", "r3"]  # none dropped, none hangs
    failed = [o for o in done.values() if o.finish_reason == "error"]
    assert sorted(o.request_id for o in failed) == ["r0", "r1"]  # the two running at the fault
    assert all(f"RuntimeError: injected fault in {method}" in o.error for o in failed)
    alone = LLM("random_tiny", device="cpu", runner=runner).generate([[7, 6, 7], [8, 6, 7]], GREEDY, use_tqdm=False)
    assert [done["r2"].token_ids, done["r3"].token_ids] == [o.token_ids for o in alone]  # served as usual
    assert_engine_drained(engine)
    engine.add_request("after", [5, 6, 7], GREEDY)
    assert _run(engine)["after"].finish_reason == "length"


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_repeated_faults_mark_the_engine_dead(runner, one_thread):
    llm = LLM("random_tiny", device="cpu", runner=runner, max_num_seqs=2)
    engine = llm.engine
    for i in range(5):
        engine.add_request(f"r{i}", [5 + i, 6, 7], GREEDY)
    _inject(engine.runner, "execute_model", set(range(1, 100)))
    done = _run(engine)
    assert sorted(done) == [f"r{i}" for i in range(5)]
    assert all(o.finish_reason == "error" for o in done.values())
    assert "stopped" not in done["r0"].error and "injected fault" in done["r4"].error
    assert not engine.has_unfinished_requests()
    for call in (engine.step, lambda: engine.add_request("x", [1, 2], GREEDY)):
        with pytest.raises(EngineDeadError, match=f"stopped after {MAX_CONSECUTIVE_STEP_FAILURES} failing steps"):
            call()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_sampler_fault_behaves_like_a_forward_fault(runner, one_thread):
    llm = LLM("random_tiny", device="cpu", runner=runner, async_scheduling=False)
    engine = llm.engine
    target = engine.runner.sampler if runner == "v2" else None
    if target is not None:
        original = target.__class__.__call__
        calls = {"n": 0}

        def broken(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ValueError("injected sampler fault")
            return original(self, *args, **kwargs)

        engine.runner.sampler = _CallProxy(target, broken)
    else:
        import framework.runner.v1.model_runner as v1

        original_rows, calls = v1.sample_fused, {"n": 0}

        def broken_rows(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise ValueError("injected sampler fault")
            return original_rows(*args, **kwargs)

        v1.sample_fused = broken_rows
    try:
        engine.add_request("a", [5, 6, 7], GREEDY)
        done = _run(engine)
    finally:
        if target is None:
            v1.sample_fused = original_rows
    assert done["a"].finish_reason == "error" and "ValueError: injected sampler fault" in done["a"].error
    assert len(done["a"].token_ids) == 1
    assert_engine_drained(engine)


class _CallProxy:
    """Stands in for the sampler: calls `fn(target, ...)`, forwards every other attribute."""

    def __init__(self, target, fn):
        self._target, self._fn = target, fn

    def __call__(self, *args, **kwargs):
        return self._fn(self._target, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._target, name)


# ---- start-up failures free what they allocated -----------------------------------------------------------
@pytest.mark.parametrize("where", ["weights", "kv_cache"])
def test_startup_failure_is_clear_and_frees_the_model(where, monkeypatch):
    import framework.models.setup as setup
    from framework import ConfigError
    from framework.models import CheckpointError

    refs = []
    build = setup.build_model

    def tracked_build(*args, **kwargs):
        model = build(*args, **kwargs)
        refs.append(weakref.ref(model))
        return model

    monkeypatch.setattr(setup, "build_model", tracked_build)
    if where == "weights":

        def failing_init(*args, **kwargs):
            raise CheckpointError("injected: reading weights failed")

        monkeypatch.setattr(setup, "init_random_weights", failing_init)
        expected, kwargs = (CheckpointError, "injected: reading weights failed"), {}
    else:
        expected, kwargs = (ConfigError, "too small for one request"), {"num_kv_blocks": 8}
    with pytest.raises(expected[0], match=expected[1]) as err:
        LLM("random_tiny", device="cpu", **kwargs)
    gc.collect()
    assert refs and refs[0]() is None, "the model outlived the failed start-up"
    # The exception is still alive with its traceback down into the engine's start-up, whose frames held the
    # model: they no longer pin it (clearing the traceback would also pass the check above, and fail this one).
    frames, tb = [], err.value.__traceback__
    while tb is not None:
        frames.append(Path(tb.tb_frame.f_code.co_filename).name)
        tb = tb.tb_next
    assert "core.py" in frames and "setup.py" in frames, frames


# ---- NaN / inf logits: one request's error, nobody else's -------------------------------------------------
@pytest.mark.parametrize("runner", ["v2", "v1"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_logits_end_only_that_request(runner, value, one_thread):
    """A fault-injecting wrapper around compute_logits poisons one request's row at one step."""
    prompts = [[5, 10, 11], [6, 10, 11], [7, 10, 11]]
    clean = LLM("random_tiny", device="cpu", runner=runner).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM("random_tiny", device="cpu", runner=runner)
    r = llm.engine.runner
    original_sample, original_logits, state = r.sample_tokens, r.model.compute_logits, {"step": 0, "ids": []}

    def sample_tokens():
        pending = r._pending
        state["ids"] = [] if pending is None else list(getattr(pending[0], "batch", pending[0]).request_ids)
        state["step"] += 1
        return original_sample()

    def compute_logits(hidden):
        logits = original_logits(hidden)
        if state["step"] == 4 and "gen-1" in state["ids"]:
            logits[state["ids"].index("gen-1"), ::7] = value
        return logits

    r.sample_tokens, r.model.compute_logits = sample_tokens, compute_logits
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[1].finish_reason == "error" and "NaN or +inf" in outs[1].error
    assert outs[1].token_ids == clean[1].token_ids[:3]  # the poisoned step produced nothing
    for i in (0, 2):
        assert outs[i].token_ids == clean[i].token_ids and outs[i].error is None
    assert_engine_drained(llm.engine)


# ---- the leak checks themselves -----------------------------------------------------------------------------
def test_invariant_check_catches_leaks_and_is_off_by_default(leak_check):
    from framework.config.schema import SchedulerConfig
    from framework.engine.request import Request
    from framework.engine.scheduler.kv_cache_manager import KVCacheManager
    from framework.engine.scheduler.scheduler import Scheduler

    assert SchedulerConfig().check_invariants is False
    kv = KVCacheManager(8, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=32), kv, 64)
    sched.add_request(Request("a", [1, 2, 3], GREEDY))
    out = sched.schedule()
    sched.check_invariants()
    sched.update_from_output(out, [[4]])
    with pytest.raises(AssertionError, match="requests left in the scheduler"):
        leak_check(sched)
    sched.abort_request("a")
    leak_check(sched)
    kv.allocate("ghost", 5)  # blocks held by a request the scheduler does not know
    with pytest.raises(AssertionError, match="held by a request that is not running"):
        sched.check_invariants()
    kv.free("ghost")
    kv._blocks["ghost"] = [next(iter(kv._free))]  # a block both free and held
    with pytest.raises(AssertionError, match="KV block pool leak: 8 free"):
        kv.check_conservation()
    kv._blocks.pop("ghost")
    kv._ref_cnt[0] = 1  # a free block with a reference
    with pytest.raises(AssertionError, match="reference counts wrong"):
        kv.check_conservation()
