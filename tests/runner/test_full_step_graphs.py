"""Full-step graphs (framework/runner/graphs/step_graphs.py) on the CPU: the whole pure-decode step as one "replay".

`StaticInputsCapturer` (tests/helpers/fake_graphs.py) replays by running the captured step again, and fails if the
step reads a storage it did not read at capture or reads device data on the host: what a real CUDA graph
would get wrong silently. The claims:

- tokens with full-step graphs on equal tokens with them off, step by step (greedy, seeded temperature,
  top-k / top-p / min-p, repetition / frequency / presence penalties, per-request seeds), with requests
  joining and leaving, padding rows, preemption, and batches that mix graph-safe rows with rows that need the
  eager sampler (those steps fall back, named);
- the fallback decision names its reason, and a batch of unconstrained rows never takes the eager path;
- negative controls: a step reading a tensor reallocated after capture, a host read inside the step, padding
  rows whose KV stores land, and penalty counts that do not advance are all caught;
- configurations that keep today's path (speculation, Mamba state) say why;
- with the GPU's Triton kernels forced (interpreter), the captured step still reads only static inputs.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer, StaticInputsCapturer, StaticInputsViolation
from helpers.graph_lockstep import record_preemptions, run_in_lockstep
from helpers.observed import counted

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from framework.params.scheduler_output import SchedulerOutput
from framework.runner.graphs.step_graphs import (
    CUTOFF_STAGES,
    PENALTY_STAGES,
    PLAIN_STAGES,
    VARIANTS,
    FullStepGraphs,
    RowNeeds,
    full_step_blocker,
    general_stages,
    graph_stages,
)
from samplers.states import SamplingStages

pytestmark = pytest.mark.usefixtures("one_thread")
GENERAL = general_stages(5)

BASE = {
    "device": "cpu",
    "dtype": "float32",
    "seed": 0,
    "max_num_seqs": 6,
    "max_model_len": 64,
    "async_scheduling": True,
}
SAFE = [  # graph-safe sampling mixes
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, seed=11),
    SamplingParams(temperature=1.0, top_k=5, seed=12),
    SamplingParams(temperature=0.7, top_p=0.6, seed=13),
    SamplingParams(temperature=1.2, min_p=0.2, seed=14),
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05),  # unseeded: the engine seed decides
    SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.5),
    SamplingParams(temperature=0.8, seed=15, frequency_penalty=0.7, top_k=30),
]
UNSAFE = [  # each makes its step fall back to the eager sampler
    SamplingParams(temperature=0.0, bad_words=[[7, 9]]),
    SamplingParams(temperature=0.5, seed=22, prompt_logprobs=1),
]


def _llm(full_step: bool, model: str = "tiny", **kwargs: Any) -> LLM:
    llm = LLM(model, **{**BASE, "full_step_cuda_graphs": full_step, **kwargs})
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    counted(llm)  # the observer counts the replays from the first step on
    return llm


def _work(params: list[SamplingParams], n: int = 9) -> list[tuple[int, list[int], SamplingParams]]:
    """Staggered arrivals with prompts and lengths of their own; the parameter mixes rotate over requests."""
    g = torch.Generator().manual_seed(5)
    out = []
    for i in range(n):
        prompt = torch.randint(0, 250, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g).tolist()
        p = params[i % len(params)]
        length = int(torch.randint(3, 15, (1,), generator=g))
        out.append((2 * i if i < 6 else 12 + i, prompt, _with(p, max_tokens=length, ignore_eos=True)))
    return out


def _with(p: SamplingParams, **changes: Any) -> SamplingParams:
    fields = {
        k: getattr(p, k)
        for k in (
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "seed",
            "logprobs",
            "min_tokens",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "allowed_token_ids",
            "bad_words",
            "prompt_logprobs",
            "stop_token_ids",
        )
    }
    return SamplingParams(**{**fields, **changes})


def _record_runs(llm: LLM) -> list[tuple[int, int]]:
    """(real rows, padded rows) of every full-step replay from now on."""
    graphs = llm.engine.runner.graphs.step_graphs
    assert graphs is not None, "no full-step graphs were captured"
    log: list[tuple[int, int]] = []
    run = graphs.run

    def recorded(output, slots, *args):  # type: ignore[no-untyped-def]
        log.append((len(slots), graphs.padded_size(len(slots))))
        return run(output, slots, *args)

    graphs.run = recorded  # type: ignore[method-assign]
    return log


def _lockstep(off: LLM, on: LLM, work: list[tuple[int, list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Both engines get the same arrivals; after every step their tokens and logprobs must be equal."""

    def check(step: int, outs_off: list, outs_on: list) -> None:
        outs = [{o.request_id: (list(o.token_ids), _logprob_ids(o)) for o in s} for s in (outs_off, outs_on)]
        assert outs[0] == outs[1], f"step {step}: outputs differ"
        values = [{o.request_id: _logprob_values(o) for o in s} for s in (outs_off, outs_on)]
        assert values[0].keys() == values[1].keys()
        for rid, expected in values[0].items():
            assert torch.allclose(values[1][rid], expected, rtol=1e-5, atol=1e-5), f"step {step}: {rid}'s logprobs"

    return run_in_lockstep(off, on, work, check)


def _logprob_ids(out: Any) -> Any:
    """Per output position: the (token id, rank) pairs of its logprobs entry (None: the request asked none)."""
    lp = getattr(out, "logprobs", None)
    return None if lp is None else [sorted((t, e.rank) for t, e in d.items()) for d in lp]


def _logprob_values(out: Any) -> torch.Tensor:
    """Every logprob of the request's entries, in token-id order per position (-inf kept)."""
    lp = getattr(out, "logprobs", None) or []
    return torch.tensor([d[t].logprob for d in lp for t in sorted(d)], dtype=torch.float64)


def test_graph_safe_mixes_equal_eager_with_padding() -> None:
    off, on = _llm(False), _llm(True)
    runs = _record_runs(on)
    tokens = _lockstep(off, on, _work(SAFE))
    assert len(tokens) == 9 and all(tokens.values())
    r, counts = on.engine.runner, counted(on)
    assert any(rows < size for rows, size in runs), "no replay had padding rows"
    assert len({rows for rows, _ in runs}) >= 3, "too few batch sizes replayed"
    assert set(counts.full_step_fallbacks) == {"not pure decode"}  # unconstrained rows: every decode step replays
    assert counts.full_step_replays == len(runs) > 10
    assert r.eager_forwards == off.engine.runner.eager_forwards  # prefill steps only, as with graphs off
    replayed = {key[1] for key, graph in r.graphs.step_graphs.graphs.items() if graph.num_replays}
    assert replayed == set(VARIANTS), "every sampling variant but the general one must have served steps"


def test_preemption_equals_eager() -> None:
    small = {"block_size": 4, "num_kv_blocks": 12, "max_model_len": 32}
    off, on = _llm(False, **small), _llm(True, **small)
    preempted = record_preemptions(on)
    work = [(i, [3 + i, 7, 9, 11 + i], _with(SAFE[i % len(SAFE)], max_tokens=14, ignore_eos=True)) for i in range(5)]
    _lockstep(off, on, work)
    assert preempted, "nothing was preempted"
    assert counted(on).full_step_replays > 5


def test_mixed_safe_and_unsafe_rows_fall_back_with_reasons() -> None:
    off, on = _llm(False), _llm(True)
    _lockstep(off, on, _work(SAFE[:3] + UNSAFE, n=9))
    counts = counted(on)
    reasons = set(counts.full_step_fallbacks)
    assert {"bad_words", "prompt logprobs"} & reasons, reasons
    assert counts.full_step_replays > 0, "no step ran as one graph (the last rows are graph-safe)"


def test_blocker_names_each_reason() -> None:
    def so(n_tokens: list[int], drafts: list[int] | None = None) -> SchedulerOutput:
        ids = [f"r{i}" for i in range(len(n_tokens))]
        return SchedulerOutput(ids, n_tokens, drafts or [0] * len(n_tokens), [], [])

    plain = SamplingStages(any_random=False, any_top_k=False, any_top_p=False, any_min_p=False)

    def needs(**kw: Any) -> Any:
        extra = {k: kw.pop(k) for k in ("prompt_logprobs", "pooling") if k in kw}
        return lambda: RowNeeds(
            SamplingStages(**{**plain.__dict__, **kw}), extra.get("prompt_logprobs", False), extra.get("pooling", False)
        )

    assert full_step_blocker(so([1, 1, 1]), 4, needs()) is None
    assert full_step_blocker(so([1, 5]), 4, needs()) == "not pure decode"
    assert full_step_blocker(so([1, 1], [0, 2]), 4, needs()) == "not pure decode"
    assert full_step_blocker(so([1] * 5), 4, needs()) == "more rows than the largest graph"
    cases = {
        "prompt logprobs": {"prompt_logprobs": True},
        "structured outputs": {"any_structured": True},
        "bad_words": {"any_bad_words": True},
        "logits processors": {"processors": (0,)},
        "pooling": {"pooling": True},
    }
    for reason, kw in cases.items():
        assert full_step_blocker(so([1, 1]), 4, needs(**kw)) == reason
    inside = {"num_logprobs": 0, "any_allowed_tokens": True, "any_min_tokens": True, "any_logit_bias": True}
    for key, value in inside.items():  # these run inside the general variant
        assert full_step_blocker(so([1, 1]), 4, needs(**{key: value})) is None, key
        assert graph_stages(SamplingStages(**{**plain.__dict__, key: value}), GENERAL) is GENERAL, key
    assert full_step_blocker(so([1, 1]), 4, needs(num_logprobs=3), logprobs_inside=False) == "processed logprobs"
    asked: list[int] = []
    full_step_blocker(so([1, 3]), 4, lambda: asked.append(1))  # type: ignore[arg-type,return-value]
    assert not asked, "a prefill step computed the rows' sampling needs"
    assert graph_stages(plain, GENERAL) is PLAIN_STAGES
    assert graph_stages(SamplingStages(True, False, True, False), GENERAL) is CUTOFF_STAGES
    assert graph_stages(SamplingStages(False, False, False, False, any_penalties=True), GENERAL) is PENALTY_STAGES
    assert full_step_blocker(so([1, 1]), 4, needs(any_penalties=True)) is None  # penalties run in the graph


# ---- negative controls ---------------------------------------------------------------------------------------


def test_a_tensor_reallocated_after_capture_is_caught(caplog: pytest.LogCaptureFixture) -> None:
    """A real graph keeps reading the old address; the checker must refuse the replay (the engine ends the
    step's requests with the error and logs it)."""
    on = _llm(True)
    rs = on.engine.runner.request_state
    rs.last_sampled = rs.last_sampled.clone()
    _drive(on)
    assert (
        "StaticInputsViolation: the replayed step read 1 storage(s) it did not read at capture and made host "
        "read(s) of device data: []"
    ) in caplog.text


def test_a_host_read_inside_the_step_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    import framework.runner.graphs.step_graphs as sg

    prepare = sg.prepare_inputs

    def reads_host(idx, *args):  # type: ignore[no-untyped-def]
        if int(idx.max()) < 0:  # a host-dependent branch: frozen at capture in a real graph
            raise AssertionError
        return prepare(idx, *args)

    monkeypatch.setattr(sg, "prepare_inputs", reads_host)
    with pytest.raises(StaticInputsViolation, match="host read.*__int__ at test_full_step_graphs.py"):
        _llm(True)


def test_padding_rows_storing_kv_are_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Padding rows whose KV stores land (in the dummy row's block 0, a live request's block) change tokens."""
    import framework.runner.graphs.step_graphs as sg

    monkeypatch.setattr(sg, "skip_padding_stores", lambda kv_slots, idx, dummy: kv_slots)
    off, on = _llm(False), _llm(True)
    long_first = [(0, [9, 4, 7, 1], _with(SAFE[0], max_tokens=20, ignore_eos=True))]  # holds block 0 throughout
    long_first += [(2 + i, [5 + i, 6], _with(SAFE[i], max_tokens=6, ignore_eos=True)) for i in range(1, 3)]
    with pytest.raises(AssertionError, match="outputs differ"):
        _lockstep(off, on, long_first)


def _drive(llm: LLM) -> None:
    for i in range(3):
        llm.engine.add_request(f"r{i}", [4, 5, 6 + i], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    for _ in range(8):
        if not llm.engine.has_unfinished_requests():
            break
        llm.engine.step()


# ---- configurations that keep today's path -------------------------------------------------------------------


def test_on_by_default_and_unsupported_configs_say_why(caplog: pytest.LogCaptureFixture) -> None:
    assert LLM("tiny", **BASE).config.runner.full_step_cuda_graphs is True  # measured on the H200: it pays
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with caplog.at_level(logging.INFO, logger="framework.runner.model_runner"):
        spec = _llm(True, speculative_config=ngram)
        hybrid = LLM("jamba-tiny", **{**BASE, "full_step_cuda_graphs": True})
        hybrid.engine.runner.capture_cuda_graphs(EagerReplayCapturer())  # its CPU conv reference reads the host
    assert spec.engine.runner.graphs.step_graphs is None and hybrid.engine.runner.graphs.step_graphs is None
    assert spec.engine.runner.graphs.cuda_graphs is not None  # the forward graphs stay
    text = caplog.text
    assert "no full-step CUDA graphs: speculative decoding" in text
    assert "overrides" in text and "mamba" in text.lower()


def test_full_step_graphs_capture_both_variants_per_size() -> None:
    graphs: FullStepGraphs = _llm(True).engine.runner.graphs.step_graphs
    assert set(graphs.graphs) == {(s, v) for s in (1, 2, 4, 6) for v in VARIANTS + (general_stages(20),)}
    assert graphs.general == general_stages(20)  # sampler.max_logprobs


PENALISED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.6),
    SamplingParams(temperature=0.9, seed=31, presence_penalty=1.0, top_p=0.9),
    SamplingParams(temperature=0.0),
]


def test_penalty_counts_advance_inside_the_graph() -> None:
    """Penalised rows replay whole; negative control: a graph that does not advance the counts is caught."""
    off, on = _llm(False), _llm(True)
    work = [(i, [3 + i, 3 + i, 8, 9], _with(PENALISED[i % 3], max_tokens=24, ignore_eos=True)) for i in range(4)]
    _lockstep(off, on, list(work))
    graphs = on.engine.runner.graphs.step_graphs
    assert any(g.num_replays for (_, v), g in graphs.graphs.items() if v is PENALTY_STAGES)
    off, on = _llm(False), _llm(True)
    on.engine.runner.sampling_states.record_sampled = lambda *args: None  # planted: counts never advance
    with pytest.raises(AssertionError, match="outputs differ"):
        _lockstep(off, on, list(work))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_triton_kernels_of_the_step_read_only_static_inputs(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """The GPU's kernels (input prep, num_sampled, post-update, penalties, the fused sampler) inside the captured
    step, under the interpreter: their wrappers read nothing on the host and nothing allocated after capture. A
    bf16 model's steps hand the fused sampler its bf16 logits, or a float32 copy while a row has penalties (the
    penalty variant), captured or eager alike."""
    import framework.layers.kernels.input_prep
    import samplers.penalties
    import samplers.penalty_counts
    import samplers.sampler

    monkeypatch.setattr(framework.layers.kernels.input_prep, "use_triton", lambda tensor, force=None: True)
    for module in (samplers.penalties, samplers.penalty_counts, samplers.sampler):
        monkeypatch.setattr(module, "use_triton", lambda tensor: True)
    calls: list[str] = []
    kernels = (
        (samplers.sampler, "sample_fused_triton"),
        (framework.layers.kernels.input_prep, "post_update_triton"),
        (samplers.penalties, "apply_penalties_triton"),
    )
    for module, name in kernels:
        fn = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name), _fn(*a, **k))[1])
    fed: list[torch.dtype] = []
    sample = samplers.sampler.sample_fused_triton
    monkeypatch.setattr(
        samplers.sampler,
        "sample_fused_triton",
        lambda logits, *a, **k: fed.append(logits.dtype) or sample(logits, *a, **k),
    )
    small = {"max_num_seqs": 4, "dtype": dtype}
    off, on = _llm(False, model="random_tiny", **small), _llm(True, model="random_tiny", **small)
    params = [SAFE[0], SAFE[2], PENALISED[1]]
    work = [(i, [5 + i, 9, 2 + i], _with(params[i], max_tokens=5, ignore_eos=True)) for i in range(3)]
    _lockstep(off, on, work)
    assert counted(on).full_step_replays >= 3
    assert {"sample_fused_triton", "post_update_triton", "apply_penalties_triton"} <= set(calls)
    assert set(fed) == ({torch.bfloat16, torch.float32} if dtype == "bfloat16" else {torch.float32})


def test_structured_rows_fall_back_and_the_rest_replay() -> None:
    """A grammar-constrained request joins replayed steps (they fall back while it runs), finishes, and the
    graph takes over again; the matchers see every token either way."""
    from framework import StructuredOutputsParams

    off, on = _llm(False, model="random_tiny"), _llm(True, model="random_tiny")
    regex = StructuredOutputsParams(regex=r"[a-z]{3,6}-[0-9]{2}")
    work = [
        (0, [5, 6, 7], _with(SAFE[1], max_tokens=20, ignore_eos=True)),
        (1, [8, 9], _with(SAFE[2], max_tokens=22, ignore_eos=True)),
        (4, [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=regex)),
    ]
    tokens = _lockstep(off, on, work)
    counts = counted(on)
    assert counts.full_step_fallbacks["structured outputs"] > 0 and counts.full_step_replays > 5
    text = on.engine.tokenizer.decode(tokens["r4"])
    assert re.fullmatch(r"[a-z]{3,6}-[0-9]{2}", text), text


def test_full_step_graphs_with_the_small_batch_kernels_equal_the_default_path() -> None:
    """The two issue-25 paths together: a replayed whole step whose forward takes the GEMVs (<= 8 tokens)."""
    off, on = _llm(False), _llm(True, small_batch_kernels="on")
    assert on.engine.runner.model.model.layers[0].small_batch_max_tokens > 0, "the GEMV path is not enabled"
    _lockstep(off, on, _work(SAFE[:4], n=6))
    assert counted(on).full_step_replays > 5
