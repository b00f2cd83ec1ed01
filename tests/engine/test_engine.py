"""Engine behaviour on the tiny model: slots, seeds, preemption, chunking, aborts and bad requests."""

from __future__ import annotations

import random

import pytest
import torch

from framework import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def _run_alone(factory, prompt, params):
    return factory().generate([prompt], params, use_tqdm=False)[0].token_ids


def test_seeded_request_same_alone_and_in_batch(tiny_llm_factory):
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    prompt = _prompts(1, seed=7)[0]
    alone = _run_alone(tiny_llm_factory, prompt, seeded)
    others = _prompts(8, seed=8)
    params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 8
    outs = tiny_llm_factory().generate(
        others[:4] + [prompt] + others[4:], params[:4] + [seeded] + params[4:], use_tqdm=False
    )
    assert outs[4].token_ids == alone
    # And the seed matters: another seed gives another sequence.
    other_seed = SamplingParams(temperature=0.9, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert _run_alone(tiny_llm_factory, prompt, other_seed) != alone


def test_batched_greedy_equals_alone(tiny_llm_factory, hf_greedy_reference):
    prompts = _prompts(6, seed=1)
    batched = tiny_llm_factory().generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, batched):
        assert out.token_ids == _run_alone(tiny_llm_factory, prompt, GREEDY)
    # Both arms above share any bug of attention or KV reads: HF transformers on the same weights does not.
    assert [o.token_ids for o in batched] == hf_greedy_reference(prompts, GREEDY.max_tokens)


def test_greedy_under_preemption_and_chunked_prefill_equals_hf(tiny_llm_factory, hf_greedy_reference):
    """Preempted, resumed and chunked requests read their KV back from blocks written in earlier steps: their
    greedy tokens are HF's."""
    prompts = _prompts(6, seed=4)
    small = tiny_llm_factory(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == hf_greedy_reference(prompts, 16)


def test_preemption_and_chunked_prefill_do_not_change_outputs(tiny_llm_factory):
    prompts = _prompts(6, seed=2)
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True)
    reference = tiny_llm_factory().generate(prompts, params, use_tqdm=False)
    # 16 blocks of 4 tokens = 64 token slots for up to 6 requests of up to 64 tokens: preemption is certain.
    small = tiny_llm_factory(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8)
    outs = small.generate(prompts, params, use_tqdm=False)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in reference]
    assert small.engine.num_free_blocks == 16


def test_request_finishing_mid_batch_moves_no_other_state(tiny_llm_factory):
    llm = tiny_llm_factory(max_num_seqs=4)
    engine = llm.engine
    lengths = [20, 3, 20, 20]  # the second request finishes first, in the middle of the batch
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", [10 + i, 20, 30], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    engine.step()
    rs = engine.runner.request_state
    slots = dict(rs.req_id_to_slot)
    snapshot = {r: rs.all_token_ids[s, :4].clone() for r, s in slots.items()}
    finished = []
    while "r1" not in [o.request_id for o in finished]:
        finished += engine.step()
    engine.step()  # the runner frees r1's slot at the next step
    assert "r1" not in rs.req_id_to_slot
    for r in ("r0", "r2", "r3"):
        assert rs.req_id_to_slot[r] == slots[r]
        assert torch.equal(rs.all_token_ids[slots[r], :4], snapshot[r])


def test_reused_slot_carries_nothing_of_previous_owner(tiny_llm_factory):
    prompt = _prompts(1, seed=3)[0]
    sampled = SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.1, seed=3, max_tokens=10, ignore_eos=True)
    fresh = _run_alone(tiny_llm_factory, prompt, GREEDY)
    llm = tiny_llm_factory(max_num_seqs=1)  # one slot: every request reuses it
    llm.generate([_prompts(1, seed=4)[0]], sampled, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == fresh


def test_abort_frees_blocks_and_others_continue(tiny_llm_factory):
    llm = tiny_llm_factory()
    engine = llm.engine
    total = engine.num_free_blocks
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    out = engine.abort_request("r1")
    assert out is not None and out.finish_reason == "abort"
    assert engine.abort_request("r1") is None  # already ended: nothing to abort
    done = []
    while engine.has_unfinished_requests():
        done += engine.step()
    assert sorted(o.request_id for o in done) == ["r0", "r2"]
    assert all(len(o.token_ids) == 8 for o in done)
    assert engine.num_free_blocks == total


def test_stop_conditions(tiny_llm_factory):
    llm = tiny_llm_factory()
    prompt = _prompts(1, seed=5)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    stop_at = free.token_ids[2]
    assert stop_at not in free.token_ids[:2]  # else the request would stop before index 2 (an echoing model)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]), use_tqdm=False)[
        0
    ]
    assert out.token_ids == free.token_ids[:3]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert free.finish_reason == "length"
    # max_model_len caps the output.
    capped = tiny_llm_factory(max_model_len=16).generate(
        [list(range(10))], SamplingParams(max_tokens=50), use_tqdm=False
    )
    assert len(capped[0].token_ids) == 6 and capped[0].finish_reason == "length"


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "the prompt is empty"),
        ([1, 2, 5000], SamplingParams(), r"token id 5000 is outside the vocabulary \[0, 320\)"),
        ([1, -1], SamplingParams(), "token id -1 is outside the vocabulary"),
        ([True, False], SamplingParams(), r"token id True is outside the vocabulary \[0, 320\)"),
        (list(range(200)) * 6, SamplingParams(), "the prompt has 1200 tokens but max_model_len is 1024"),
        ([1, 2], SamplingParams(logprobs=50), "logprobs=50 exceeds sampler.max_logprobs=20"),
        (
            [1, 2],
            SamplingParams(allowed_token_ids=[256], min_tokens=2),  # 256: the byte tokenizer's eos
            r"allowed_token_ids \[256\] are all stop tokens .*min_tokens=2",
        ),
        (
            [1, 2],
            SamplingParams(allowed_token_ids=[7, 9], stop_token_ids=[7, 9], min_tokens=1, ignore_eos=True),
            r"allowed_token_ids \[7, 9\] are all stop tokens \(SamplingParams.stop_token_ids.*min_tokens=1",
        ),
        ([1, 2], SamplingParams(allowed_token_ids=[7], bad_words=[[7]]), "allowed_token_ids .*bad_words"),
    ],
)
def test_bad_requests_are_refused_and_nothing_else_breaks(tiny_llm, prompt, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate([[3, 4, 5], prompt], params, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()  # the good prompt was not queued either
    assert tiny_llm.generate([[3, 4, 5]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_a_request_that_fails_mid_run_ends_alone(tiny_llm_factory, leak_check, monkeypatch):
    """Constraints validation cannot see through (a grammar that has ended before `min_tokens`, with the
    validation's grammar walk undecided, as for a grammar too large to walk) end that request with an error at
    the step where nothing is left to sample; the request beside it completes."""
    from framework.params.structured_outputs import StructuredOutputsParams

    engine = tiny_llm_factory().engine
    monkeypatch.setattr(type(engine.runner.grammar_backend), "can_run_for", lambda *a, **k: None)
    stuck = SamplingParams(structured_outputs=StructuredOutputsParams(choice=["a"]), min_tokens=4, max_tokens=8)
    engine.add_request("stuck", [1, 2, 3], stuck)
    engine.add_request("fine", [1, 2, 3], GREEDY)
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert finished["stuck"].finish_reason == "error" and "no token can be sampled" in finished["stuck"].error
    assert finished["fine"].finish_reason == "length" and len(finished["fine"].token_ids) == GREEDY.max_tokens
    assert finished["fine"].error is None
    leak_check.engine(engine)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1.0}, "temperature=-1.0 is invalid"),
        ({"top_p": 0.0}, r"top_p=0.0 is invalid: must be in \(0, 1\]"),
        ({"top_k": -5}, "top_k=-5 is invalid"),
        ({"min_p": 1.5}, "min_p=1.5 is invalid"),
        ({"max_tokens": 0}, "max_tokens=0 is invalid"),
        ({"presence_penalty": 3.0}, "presence_penalty=3.0 is invalid"),
        ({"repetition_penalty": 0.0}, "repetition_penalty=0.0 is invalid"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens=20 is invalid"),
    ],
)
def test_invalid_sampling_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_duplicate_request_id(tiny_llm_factory):
    engine = tiny_llm_factory().engine
    engine.add_request("x", [1, 2], GREEDY)
    with pytest.raises(InvalidRequestError, match="request id 'x' is already in use"):
        engine.add_request("x", [3, 4], GREEDY)


def test_kv_cache_too_small_for_one_request_at_startup(tiny_llm_factory):
    from framework import ConfigError

    with pytest.raises(ConfigError, match="too small for one request of max_model_len=1024"):
        tiny_llm_factory(num_kv_blocks=8)


def test_profile_run_leaves_no_state_behind(tiny_llm_factory):
    """The profile run's dummy requests (every slot, temperature 1, top-k 50, prompts of zeros) leave nothing
    behind: greedy and seeded requests in all four slots then give a fresh engine's tokens."""
    llm = tiny_llm_factory(max_num_batched_tokens=64, max_num_seqs=4)
    runner = llm.engine.runner
    kv = runner.kv_caches
    assert runner.profile_run() == 0  # CPU: no device peak to measure
    assert runner.request_state.num_active == 0 and len(runner.request_state.free_slots) == 4
    runner.kv_caches = kv
    prompts = _prompts(4, seed=11)
    seeded = SamplingParams(temperature=0.8, seed=17, max_tokens=12, ignore_eos=True)
    params = [GREEDY, seeded, GREEDY, seeded]
    fresh = tiny_llm_factory(max_num_batched_tokens=64, max_num_seqs=4).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == [o.token_ids for o in fresh]


@pytest.mark.parametrize("small_cache", [False, True])
def test_async_scheduling_gives_the_same_outputs(tiny_llm_factory, small_cache):
    prompts = _prompts(7, seed=9)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=5 + 3 * i, ignore_eos=i % 2 == 0, stop_token_ids=[7, 9])
        for i in range(7)
    ]
    kwargs = dict(num_kv_blocks=16, block_size=4, max_model_len=64, max_num_batched_tokens=8) if small_cache else {}
    sync = tiny_llm_factory(async_scheduling=False, **kwargs).generate(prompts, params, use_tqdm=False)
    llm = tiny_llm_factory(async_scheduling=True, **kwargs)
    asyn = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in asyn] == [(o.token_ids, o.finish_reason) for o in sync]
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(asyn, params))
    if small_cache:
        assert sum(o.num_preemptions for o in asyn) > 0
    assert llm.engine.num_free_blocks == llm.engine.kv_cache.num_blocks


def test_shutdown_frees_the_kv_cache_and_refuses_new_requests() -> None:
    from framework.engine.failure import EngineDeadError
    from framework.entrypoints.llm import LLM
    from framework.params.sampling_params import SamplingParams

    llm = LLM("random_tiny", device="cpu")
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].token_ids
    llm.shutdown()
    assert llm.engine.runner.kv_caches == [] and llm.engine.runner.graphs.cuda_graphs is None
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.parametrize("shape", [(5, 1), (3, 4), (7, 6), (0, 2), (4,)])
def test_async_output_landing_view_is_contiguous(shape) -> None:
    """The pinned buffer a step's tokens land in is viewed contiguously for any [R, k+1], k < K: a strided slice
    makes the non_blocking D2H copy wait for the device (seen as a step-long stall at k < K on the H200)."""
    from framework.runner.async_output import landing_view

    buffer = torch.arange(8 * 6, dtype=torch.int64)  # a runner's flat buffer: max_num_seqs 8, K + 1 = 6
    view = landing_view(buffer, shape)
    assert view.shape == shape and view.is_contiguous()
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    with pytest.raises(AssertionError, match="landing buffer"):
        landing_view(buffer, (9, 6))
