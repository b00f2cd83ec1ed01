"""Full-step graphs' general variant on the CPU: logprobs, min_tokens, logit_bias and allowed_token_ids inside
the replayed step (framework/runner/graphs/step_graphs.py), checked with `StaticInputsCapturer`
(tests/helpers/fake_graphs.py).

The claims:
- with these features mixed into the sampling mixes (with plain, cutoff and penalised rows), full-step graphs on
  equal them off step by step: token ids, logprob ids and ranks exactly, logprob values within 1e-5; with
  padding rows, joins and leaves, and preemption; the features visibly act (allowed tokens only, a biased stop
  id held back until min_tokens), rows that asked no logprobs get none, and every decode step replays;
- negative controls: a table widened after capture (a longer logit_bias list than was reserved) makes the
  steps that need the general variant fall back, named; the same reallocation with the guard switched off is
  caught by the capturer (a real graph would read the old table); a general variant missing the bias,
  min_tokens or allowed-tokens stage changes tokens;
- with the GPU's Triton kernels forced (interpreter), the captured step still reads only static inputs.
"""

from __future__ import annotations

from typing import Any

import pytest
from helpers.graph_lockstep import record_preemptions
from helpers.observed import counted
from test_full_step_graphs import SAFE, _drive, _llm, _lockstep, _record_runs, _with, _work

from framework.params.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")

ALLOWED = [1, 5, 9, 33, 60, 61, 200, 4000]
STOP = 12  # biased up, so that without min_tokens the request would stop at once
FEATURES = [  # rows only the general variant serves, mixed with graph-safe ones
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.8, seed=41, top_k=10, logprobs=0),
    SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[STOP], logit_bias={STOP: 40.0}),
    SamplingParams(temperature=0.7, seed=42, logit_bias={3: 4.0, 17: -100.0, 40: 2.5}, logprobs=2),
    SamplingParams(temperature=1.0, seed=43, allowed_token_ids=ALLOWED, logprobs=4),
    SamplingParams(temperature=0.0, repetition_penalty=1.4, logit_bias={8: 1.5}, top_p=0.9),
    SAFE[0],
    SAFE[3],
]


def _check_features_acted(tokens: dict[str, list[int]], work: list[tuple[int, list[int], SamplingParams]]) -> None:
    for arrival, _, params in work:
        out = tokens[f"r{arrival}"]
        if params.allowed_token_ids is not None:
            assert set(out) <= set(ALLOWED), out
        if params.min_tokens:
            assert len(out) >= params.min_tokens and STOP not in out[: params.min_tokens], out
            assert out[-1] == STOP or len(out) == params.max_tokens, out


def test_general_variant_mixes_equal_eager_with_padding() -> None:
    off, on = _llm(False), _llm(True)
    runs = _record_runs(on)
    work = _work(FEATURES, n=10)
    tokens = _lockstep(off, on, list(work))
    _check_features_acted(tokens, work)
    r, counts = on.engine.runner, counted(on)
    assert any(rows < size for rows, size in runs), "no replay had padding rows"
    assert set(counts.full_step_fallbacks) == {"not pure decode"}, counted(
        on
    ).full_step_fallbacks  # every decode step replays
    assert r.eager_forwards == off.engine.runner.eager_forwards
    graphs = r.graphs.step_graphs
    assert sum(g.num_replays for (_, v), g in graphs.graphs.items() if v == graphs.general) > 10


def test_rows_without_logprobs_get_none() -> None:
    on = _llm(True)
    engine = on.engine
    engine.add_request("lp", [4, 5, 6], SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True))
    engine.add_request("no", [7, 8], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    final: dict[str, Any] = {}
    for _ in range(12):
        final.update({o.request_id: o for o in engine.step()})
        if not engine.has_unfinished_requests():
            break
    assert final["no"].logprobs is None
    entries = final["lp"].logprobs
    assert len(entries) == 5 and all(1 <= len(d) <= 3 for d in entries)
    assert counted(on).full_step_replays >= 3


def test_general_variant_with_preemption_equals_eager() -> None:
    small = {"block_size": 4, "num_kv_blocks": 12, "max_model_len": 32}
    off, on = _llm(False, **small), _llm(True, **small)
    preempted = record_preemptions(on)
    work = [
        (i, [3 + i, 7, 9, 11 + i], _with(FEATURES[i % len(FEATURES)], max_tokens=14, ignore_eos=True)) for i in range(6)
    ]
    tokens = _lockstep(off, on, list(work))
    _check_features_acted(tokens, work)
    assert preempted, "nothing was preempted"
    assert counted(on).full_step_replays > 5


# ---- negative controls ---------------------------------------------------------------------------------------


def test_a_bias_table_widened_after_capture_falls_back_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for 8 bias entries per slot at capture; a request with 12 widens the table (a new tensor): from then on
    the general variant's steps fall back, and the tokens stay those of the eager path."""
    import framework.runner.graphs.step_graphs as sg

    monkeypatch.setattr(sg, "LOGIT_BIAS_WIDTH", 8)
    off, on = _llm(False), _llm(True)
    assert on.engine.runner.sampling_states.logit_bias.tokens.width == 8
    wide = {t: 0.5 * (t % 5) for t in range(20, 32)}
    work = [
        (0, [4, 5, 6], _with(FEATURES[3], max_tokens=16, ignore_eos=True)),
        (1, [7, 8], _with(SAFE[1], max_tokens=18, ignore_eos=True)),
        (6, [9, 10, 11], SamplingParams(temperature=0.0, logit_bias=wide, max_tokens=6, ignore_eos=True)),
    ]
    _lockstep(off, on, work)
    r, counts = on.engine.runner, counted(on)
    assert r.sampling_states.logit_bias.tokens.width == 16
    assert counts.full_step_fallbacks["sampling tables reallocated"] > 0, counts.full_step_fallbacks
    assert counts.full_step_replays > 3  # the general variant's steps before the widening, the plain rows' after


def test_a_bias_table_reallocated_behind_the_guard_is_caught(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import framework.runner.graphs.step_graphs as sg

    monkeypatch.setattr(sg, "_widenable_tables", lambda states: ())  # the guard never sees a change
    on = _llm(True)
    bias = on.engine.runner.sampling_states.logit_bias
    bias.values.values = bias.values.values.clone()
    for i in range(2):
        on.engine.add_request(
            f"b{i}", [4, 5 + i], SamplingParams(temperature=0.0, logit_bias={3: 1.0}, max_tokens=4, ignore_eos=True)
        )
    _drive(on)
    assert "StaticInputsViolation: the replayed step read 1 storage(s) it did not read at capture" in caplog.text


@pytest.mark.parametrize("stage, row", [("any_logit_bias", 3), ("any_min_tokens", 2), ("any_allowed_tokens", 4)])
def test_a_general_variant_missing_a_stage_is_caught(monkeypatch: pytest.MonkeyPatch, stage: str, row: int) -> None:
    import dataclasses

    import framework.runner.graphs.step_graphs as sg

    general = sg.general_stages
    monkeypatch.setattr(sg, "general_stages", lambda k: dataclasses.replace(general(k), **{stage: False}))
    off, on = _llm(False), _llm(True)
    work = [(i, [4 + i, 5, 6], _with(FEATURES[row], seed=50 + i, max_tokens=10, ignore_eos=True)) for i in range(3)]
    with pytest.raises(AssertionError, match="outputs differ"):
        _lockstep(off, on, work)


def test_the_general_variant_triton_kernels_read_only_static_inputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's kernels of the general variant (masks, bias, logprob stats, the fused sampler) inside the
    captured step, under the interpreter: nothing read on the host, nothing allocated after capture."""
    import framework.layers.kernels.input_prep
    import samplers.allowed_tokens
    import samplers.logit_bias
    import samplers.logprobs
    import samplers.min_tokens
    import samplers.penalties
    import samplers.penalty_counts
    import samplers.sampler

    monkeypatch.setattr(framework.layers.kernels.input_prep, "use_triton", lambda tensor, force=None: True)
    modules = (
        samplers.penalties,
        samplers.penalty_counts,
        samplers.sampler,
        samplers.allowed_tokens,
        samplers.logit_bias,
        samplers.logprobs,
        samplers.min_tokens,
    )
    for module in modules:
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    calls: list[str] = []
    kernels = (
        (samplers.allowed_tokens, "apply_allowed_tokens_triton"),
        (samplers.logit_bias, "apply_logit_bias_triton"),
        (samplers.min_tokens, "apply_min_tokens_triton"),
        (samplers.logprobs, "logprobs_stats_triton"),
        (samplers.sampler, "sample_fused_triton"),
    )
    for module, name in kernels:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    small = {"max_num_seqs": 3}
    off, on = _llm(False, model="random_tiny", **small), _llm(True, model="random_tiny", **small)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, logit_bias={7: 2.0}),
        SamplingParams(temperature=0.9, seed=3, allowed_token_ids=[2, 4, 6, 8, 10]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], logit_bias={5: 30.0}),
    ]
    work = [(i, [5 + i, 9, 2 + i], _with(params[i], max_tokens=5, ignore_eos=True)) for i in range(3)]
    _lockstep(off, on, work)
    assert counted(on).full_step_replays >= 3
    assert {name for _, name in kernels} <= set(calls)


def test_processed_logprobs_fall_back_named() -> None:
    """Processed logprobs keep the separate sampler stages: their steps fall back; the other features replay."""
    off = _llm(False, logprobs_mode="processed_logprobs")
    on = _llm(True, logprobs_mode="processed_logprobs")
    assert on.engine.runner.graphs.step_graphs.general.num_logprobs == -1
    work = [
        (0, [4, 5, 6], _with(FEATURES[2], max_tokens=12, ignore_eos=True)),
        (1, [7, 8], _with(FEATURES[4], logprobs=None, max_tokens=14, ignore_eos=True)),
        (7, [9, 10], _with(FEATURES[0], max_tokens=5, ignore_eos=True)),
    ]
    _lockstep(off, on, work)
    counts = counted(on)
    assert counts.full_step_fallbacks["processed logprobs"] > 0 and counts.full_step_replays > 5, counted(
        on
    ).full_step_fallbacks
