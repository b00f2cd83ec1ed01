"""Sampling parameters end to end on the tiny model: non-finite logits, stop strings, streaming, validation,
penalties across preemption, reused slots (logprobs: test_sampler_logprobs.py; custom logits processors:
test_custom_logits_processors.py)."""

from __future__ import annotations

import random

import pytest

from framework import InvalidRequestError, SamplingParams

TOL = 1e-4


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_nan_logits_end_only_that_request_with_an_error(tiny_llm_factory, async_scheduling):
    prompts = [_prompt(5, 10), _prompt(6, 11), _prompt(7, 12)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    clean = tiny_llm_factory().generate(prompts, params, use_tqdm=False)
    llm = tiny_llm_factory(async_scheduling=async_scheduling)
    runner = llm.engine.runner
    orig_sample, orig_logits = runner.sample_tokens, runner.model.compute_logits
    state = {"step": 0}

    def sample_tokens():
        state["ids"] = list(runner._pending.batch.request_ids) if runner._pending is not None else []
        state["step"] += 1
        return orig_sample()

    def compute_logits(hidden):
        out = orig_logits(hidden)
        if state["step"] == 4 and "gen-1" in state["ids"]:
            out[state["ids"].index("gen-1"), ::3] = float("nan")
        if "gen-2" in state["ids"]:
            out[state["ids"].index("gen-2"), :200] = float("-inf")  # excluded, but not an error
        return out

    runner.sample_tokens, runner.model.compute_logits = sample_tokens, compute_logits
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[1].finish_reason == "error" and "NaN" in outs[1].error
    assert outs[1].token_ids == clean[1].token_ids[:3]  # the NaN step produced nothing
    assert outs[0].token_ids == clean[0].token_ids and outs[0].error is None
    assert outs[2].finish_reason == "length" and all(200 <= t < 320 for t in outs[2].token_ids)
    assert llm.engine.is_idle()


def test_stop_strings_and_include_stop_str(tiny_llm_factory):
    llm = tiny_llm_factory()
    prompt = _prompt(8, 13)
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    text = free.text
    stop = text[5:7]
    first = text.find(stop)
    assert first >= 3, f"the stop string {stop!r} must match after some text, not at the start of {text!r}"
    out = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=[stop, "\x00zz"]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert len(out.token_ids) <= len(free.token_ids) and out.token_ids == free.token_ids[: len(out.token_ids)]
    incl = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )[0]
    assert incl.text == text[: first + len(stop)] and incl.token_ids == out.token_ids


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_text_is_left_out_unless_include_stop_str(tiny_llm_factory, include):
    """vLLM's semantics: the text of the token that stopped the request (a `stop_token_ids` entry, or eos) is
    not in the output text unless `include_stop_str_in_output`; the token stays in `token_ids`."""
    llm = tiny_llm_factory()
    letters = list(range(ord("a"), ord("z") + 1))  # printable one-byte tokens: every token has text
    free = llm.generate(
        [_prompt(8, 5)],
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=letters),
        use_tqdm=False,
    )[0]
    stop_at = next(t for i, t in enumerate(free.token_ids) if i >= 2 and t not in free.token_ids[:i])
    end = free.token_ids.index(stop_at) + 1
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        allowed_token_ids=letters,
        stop_token_ids=[stop_at],
        include_stop_str_in_output=include,
    )
    want = llm.tokenizer.decode(free.token_ids[:end] if include else free.token_ids[: end - 1])
    out = llm.generate([_prompt(8, 5)], params, use_tqdm=False)[0]
    assert out.token_ids == free.token_ids[:end] and out.stop_reason == stop_at
    assert out.text == want
    deltas = list(llm.generate_stream([_prompt(8, 5)], params))
    assert "".join(d.text for d in deltas) == want and deltas[-1].finished
    assert llm.engine.is_idle()


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_streaming_deltas_join_to_the_final_output(tiny_llm_factory, async_scheduling):
    llm = tiny_llm_factory(async_scheduling=async_scheduling)
    prompts = [_prompt(8, 13), _prompt(4, 14)]
    free = llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=free.text[6:9], logprobs=1),
        SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, prompt_logprobs=1),
    ]
    final = llm.generate(prompts, params, use_tqdm=False)
    joined: dict = {}
    for delta in llm.generate_stream(prompts, params):
        acc = joined.setdefault(delta.prompt_token_ids == prompts[1], {"tokens": [], "text": "", "n": 0, "lp": []})
        assert not acc.get("done"), "nothing after the final output"
        acc["tokens"] += delta.token_ids
        acc["text"] += delta.text
        acc["lp"] += delta.logprobs or []
        acc["n"] += 1
        acc["prompt_lp"] = acc.get("prompt_lp") or delta.prompt_logprobs
        acc["done"] = delta.finished
        assert free.text[6:9] not in acc["text"]  # a stop string is never streamed
    for which, out in ((False, final[0]), (True, final[1])):
        acc = joined[which]
        assert acc["done"] and acc["tokens"] == out.token_ids and acc["text"] == out.text and acc["n"] > 2
    assert len(joined[False]["lp"]) == len(final[0].token_ids)
    assert joined[True]["prompt_lp"] == final[1].prompt_logprobs


@pytest.mark.parametrize(
    "params, message",
    [
        (SamplingParams(logit_bias={400: 1.0}), r"logit_bias has token id 400, outside the vocabulary \[0, 320\)"),
        (SamplingParams(allowed_token_ids=[1, 320]), "allowed_token_ids has token id 320"),
        (SamplingParams(bad_words=[[3, 999]]), "bad_words has token id 999"),
        (SamplingParams(stop_token_ids=[5000]), "stop_token_ids has token id 5000"),
        (SamplingParams(prompt_logprobs=21), "prompt_logprobs=21 exceeds sampler.max_logprobs=20"),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused(tiny_llm, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate([[1, 2, 3]], params, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"bad_words": [[1, -2]]}, "bad_words"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x"], "detokenize": False}, "stop"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"logprobs": 1.5}, "logprobs"),
        ({"output_kind": "stream"}, "output_kind"),
        ({"top_k": 2.5}, "top_k"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens"),
        ({"extra_args": [1]}, "extra_args"),
    ],
)
def test_invalid_new_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.{message}=.* is invalid"):
        SamplingParams(**kwargs)


def test_bad_words_strings_and_min_tokens_end_to_end(tiny_llm_factory):
    llm = tiny_llm_factory()
    prepared = llm.engine._validate("x", [1], SamplingParams(bad_words=["ab", " cd", [7, 8]]))
    assert prepared.bad_words_token_ids == [[97, 98], [99, 100], [7, 8]]  # tokenised with the model's tokenizer
    prompt = _prompt(6, 15)
    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    first, pair = free.token_ids[0], tuple(free.token_ids[2:4])
    out = llm.generate(
        [prompt],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, bad_words=[[first], list(pair)]),
        use_tqdm=False,
    )[0]
    assert first not in out.token_ids and pair not in list(zip(out.token_ids, out.token_ids[1:]))
    early = llm.generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[first]), use_tqdm=False
    )[0]
    assert first not in early.token_ids[:3] and len(early.token_ids) > 3


def test_penalties_survive_preemption_and_chunking(tiny_llm_factory):
    """After preemption the prefill holds earlier output: counts are rebuilt with the prompt boundary."""
    prompts = [_prompt(n, 20 + n) for n in (10, 14, 8)]
    penalised = SamplingParams(
        temperature=0.0,
        max_tokens=14,
        ignore_eos=True,
        repetition_penalty=3.0,
        frequency_penalty=2.0,
        presence_penalty=1.5,
    )
    plain = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    sampled = SamplingParams(
        temperature=0.8,
        seed=4,
        max_tokens=14,
        ignore_eos=True,
        repetition_penalty=3.0,
        frequency_penalty=2.0,
        presence_penalty=1.5,
    )
    params = [penalised, sampled, penalised, plain]
    reference = tiny_llm_factory().generate(prompts + prompts[:1], params, use_tqdm=False)
    assert reference[0].token_ids != reference[3].token_ids  # the penalties did something
    # 8 blocks of 4 tokens hold 32 tokens, while three requests need up to 28 each: preemption is certain.
    small = tiny_llm_factory(num_kv_blocks=8, block_size=4, max_model_len=32, max_num_batched_tokens=8)
    outs = small.generate(prompts + prompts[:1], params, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]


def test_reused_slot_keeps_nothing_of_a_fully_parameterised_owner(tiny_llm_factory):
    prompt = _prompt(7, 30)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    fresh = tiny_llm_factory().generate([prompt], greedy, use_tqdm=False)[0].token_ids
    llm = tiny_llm_factory(max_num_seqs=1)
    loaded = SamplingParams(
        temperature=1.0,
        top_k=3,
        min_p=0.2,
        seed=2,
        max_tokens=6,
        min_tokens=5,
        ignore_eos=False,
        stop_token_ids=[fresh[0]],
        repetition_penalty=2.0,
        frequency_penalty=1.0,
        presence_penalty=1.0,
        logit_bias={fresh[1]: -50.0},
        allowed_token_ids=list(range(100)),
        bad_words=[[fresh[2]]],
        logprobs=3,
        prompt_logprobs=2,
    )
    llm.generate([prompt], loaded, use_tqdm=False)
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    assert out.token_ids == fresh and out.logprobs is None and out.prompt_logprobs is None


def test_cumulative_outputs_grow_and_final_only_waits(tiny_llm_factory):
    llm = tiny_llm_factory()
    engine = llm.engine
    engine.add_request(
        "cum",
        _prompt(5, 50),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, output_kind="cumulative", logprobs=0),
    )
    engine.add_request("fin", _prompt(5, 51), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    seen: dict[str, list] = {"cum": [], "fin": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    lengths = [len(o.token_ids) for o in seen["cum"]]
    assert lengths == list(range(1, 7)) and [len(o.logprobs) for o in seen["cum"]] == lengths
    assert [o.finished for o in seen["cum"]] == [False] * 5 + [True]
    assert len(seen["fin"]) == 1 and seen["fin"][0].finished and len(seen["fin"][0].token_ids) == 6


def test_v1_runner_refuses_what_it_would_ignore(tiny_llm_factory):
    llm = tiny_llm_factory(runner="v1")
    with pytest.raises(
        InvalidRequestError,
        match="the V1 runner does not apply SamplingParams presence_penalty, logprobs; use runner=v2",
    ):
        llm.generate([[1, 2]], SamplingParams(presence_penalty=0.5, logprobs=1), use_tqdm=False)
    # Text and stop strings are host-side: V1 has them too, and stops where V2 does.
    free = llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    stop = free.text[2:4]
    assert free.text.find(stop) == 2, f"the stop string {stop!r} must first match at index 2 of {free.text!r}"
    stopping = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, stop=[stop])
    out = llm.generate([[1, 2]], stopping, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == free.text[:2]
    v2 = tiny_llm_factory(runner="v2").generate([[1, 2]], stopping, use_tqdm=False)[0]
    assert (out.token_ids, out.text) == (v2.token_ids, v2.text)


SAMPLER_DISPATCH_MODULES = (
    "samplers.penalties",
    "samplers.penalty_counts",
    "samplers.sampler",
    "samplers.sanitize",
    "samplers.logprobs",
    "samplers.gumbel",
    "samplers.top_k_top_p",
    "samplers.logit_bias",
    "samplers.bad_words",
    "samplers.min_tokens",
    "samplers.allowed_tokens",
    "framework.layers.kernels.input_prep",
)


def test_engine_on_the_triton_sampler_kernels_equals_the_references(tiny_llm_factory, monkeypatch):
    """The requests of the GPU parity test (tests/gpu/test_sampler_gpu.py), once on the references and once with
    every sampler and input-prep dispatcher forced to its Triton kernel (interpreted here, as a GPU runs them):
    penalty counts and seen-token lists rebuilt, advanced and read by the listed-token kernel, fused sampling,
    logprobs."""
    import importlib

    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(5, 40))] for _ in range(4)]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.5,
            logprobs=3,
            prompt_logprobs=2,
        ),
        SamplingParams(
            temperature=0.0,
            max_tokens=8,
            ignore_eos=True,
            logit_bias={65: 3.0, 66: 2.0},
            bad_words=[[65, 66]],
            min_tokens=4,
            stop_token_ids=[67],
        ),
        SamplingParams(
            temperature=0.9,
            top_k=50,
            top_p=0.9,
            min_p=0.02,
            seed=3,
            max_tokens=8,
            ignore_eos=True,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
        ),
        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=list(range(60, 120))),
    ]
    runs = []
    for forced in (False, True):
        if forced:
            for name in SAMPLER_DISPATCH_MODULES:
                monkeypatch.setattr(importlib.import_module(name), "use_triton", lambda tensor, force=None: True)
        runs.append(tiny_llm_factory(dtype="float32").generate(prompts, params, use_tqdm=False))
    reference, triton_run = runs
    assert [o.token_ids for o in triton_run] == [o.token_ids for o in reference]
    for a, b in zip(reference[0].logprobs, triton_run[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < TOL for t in a)
    assert [set(p) for p in triton_run[0].prompt_logprobs[1:]] == [set(p) for p in reference[0].prompt_logprobs[1:]]
