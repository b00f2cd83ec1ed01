"""Logprobs end to end on the tiny model: raw and processed logprobs against the logits the sampler saw, prompt
logprobs chunked and not, bfloat16 logits sampling as float32 ones do."""

from __future__ import annotations

import torch
from test_sampler_engine import TOL, _prompt

from framework import SamplingParams
from samplers.prompt_logprobs import PromptLogprobsState


def capture_logits(llm) -> list[tuple[list[str], torch.Tensor]]:
    """Record (request ids, [R, V] logits) of every sampling step of `llm` (the first compute_logits call)."""
    runner = llm.engine.runner
    records: list = []
    orig_sample, orig_logits = runner.sample_tokens, runner.model.compute_logits
    current: dict = {}

    def sample_tokens():
        pending = runner._pending
        current["ids"] = list(pending.batch.request_ids) if pending is not None else None
        return orig_sample()

    def compute_logits(hidden):
        out = orig_logits(hidden)
        if current.get("ids") is not None:
            records.append((current.pop("ids"), out.detach().clone()))
        return out

    runner.sample_tokens = sample_tokens
    runner.model.compute_logits = compute_logits
    return records


def _logits_of(records, request_id: str) -> list[torch.Tensor]:
    """The logits row of `request_id` at each step where it was in the batch (prefill chunks included)."""
    return [logits[ids.index(request_id)] for ids, logits in records if request_id in ids]


def test_raw_logprobs_equal_log_softmax(tiny_llm_factory):
    llm = tiny_llm_factory()
    records = capture_logits(llm)
    params = [
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5),
        SamplingParams(temperature=1.0, top_k=3, seed=1, max_tokens=6, ignore_eos=True, logprobs=0),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    ]
    outs = llm.generate([_prompt(9, 1), _prompt(5, 2), _prompt(7, 3)], params, use_tqdm=False)
    assert outs[2].logprobs is None and outs[2].cumulative_logprob is None
    for i, out in enumerate(outs[:2]):
        rows = _logits_of(records, f"gen-{i}")
        assert len(rows) == len(out.token_ids) == len(out.logprobs)
        total = 0.0
        for token, entry, logits in zip(out.token_ids, out.logprobs, rows):
            ref = torch.log_softmax(logits.double(), dim=-1)
            assert abs(entry[token].logprob - float(ref[token])) < TOL
            assert entry[token].rank == 1 + int((ref > ref[token]).sum())
            top = torch.topk(ref, params[i].logprobs).indices.tolist()
            assert set(entry) == set(top) | {token}
            for t in top:
                assert abs(entry[t].logprob - float(ref[t])) < TOL
            total += float(ref[token])
        assert abs(out.cumulative_logprob - total) < 1e-3
    assert all(e[t].rank == 1 for t, e in zip(outs[0].token_ids, outs[0].logprobs))  # greedy = the argmax


def test_processed_logprobs_are_those_of_the_sampling_distribution(tiny_llm_factory):
    llm = tiny_llm_factory(logprobs_mode="processed_logprobs")
    records = capture_logits(llm)
    bias = {65: 4.0, 66: -2.0}
    params = [
        SamplingParams(temperature=0.7, top_k=5, seed=3, max_tokens=5, ignore_eos=True, logprobs=8),
        SamplingParams(temperature=0.0, logit_bias=bias, max_tokens=5, ignore_eos=True, logprobs=2),
    ]
    outs = llm.generate([_prompt(6, 4), _prompt(6, 5)], params, use_tqdm=False)
    for token, entry, logits in zip(outs[0].token_ids, outs[0].logprobs, _logits_of(records, "gen-0")):
        scaled = logits.double() / 0.7
        scaled[scaled < torch.topk(scaled, 5).values[-1]] = float("-inf")
        ref = torch.log_softmax(scaled, dim=-1)
        assert abs(entry[token].logprob - float(ref[token])) < TOL
        assert sum(1 for lp in entry.values() if lp.logprob > float("-inf")) <= 6  # only the top-5 are possible
    for token, entry, logits in zip(outs[1].token_ids, outs[1].logprobs, _logits_of(records, "gen-1")):
        biased = logits.double().clone()
        for t, b in bias.items():
            biased[t] += b
        assert token == int(biased.argmax())
        assert abs(entry[token].logprob - float(torch.log_softmax(biased, -1)[token])) < TOL


def test_prompt_logprobs_chunked_equal_unchunked(tiny_llm_factory, monkeypatch):
    prompt = _prompt(70, 6)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    whole = tiny_llm_factory().generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    monkeypatch.setattr(PromptLogprobsState, "CHUNK", 8)  # several chunks per step, and chunked prefill
    chunked = tiny_llm_factory(max_num_batched_tokens=16).generate([prompt], params, use_tqdm=False)[0]
    assert whole[0] is None and chunked.prompt_logprobs[0] is None and len(whole) == len(prompt)
    for position, (a, b) in enumerate(zip(whole[1:], chunked.prompt_logprobs[1:]), start=1):
        assert prompt[position] in a and len(a) in (3, 4)
        assert set(a) == set(b)
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < TOL and a[token].rank == b[token].rank


def test_prompt_logprob_equals_the_raw_logprob_of_forcing_that_token(tiny_llm_factory):
    """Position p's prompt logprob = raw logprob of token p+1 sampled after prompt[:p+1] (forced by allowed ids)."""
    llm = tiny_llm_factory()
    prompt = _prompt(20, 7)
    scored = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for p in (0, 7, 18):
        forced = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0, allowed_token_ids=[prompt[p + 1]])
        out = llm.generate([prompt[: p + 1]], forced, use_tqdm=False)[0]
        assert out.token_ids == [prompt[p + 1]]
        expected = scored.prompt_logprobs[p + 1][prompt[p + 1]]
        assert abs(out.logprobs[0][prompt[p + 1]].logprob - expected.logprob) < TOL


def test_bf16_logits_sample_the_tokens_and_logprobs_of_float32_ones(tiny_llm_factory, monkeypatch):
    """A bf16 model's logits reach the fused sampler (forced on: the GPU's path, under the interpreter) in bf16
    when no stage before it reads them, as a float32 copy when some request wants logprobs: greedy and seeded
    temperature / top-k / top-p / min-p tokens, and logprobs, equal those of an engine whose `compute_logits`
    returns float32 (the `.float()` it had)."""
    import samplers.sampler
    from framework.models.llama import LlamaForCausalLM

    fed: list[torch.dtype] = []
    real = samplers.sampler.sample_fused_triton
    monkeypatch.setattr(
        samplers.sampler,
        "sample_fused_triton",
        lambda logits, *a, **k: fed.append(logits.dtype) or real(logits, *a, **k),
    )
    mixes = [
        dict(temperature=0.0),
        dict(temperature=0.8, seed=1),
        dict(temperature=1.0, top_k=5, seed=2),
        dict(temperature=0.7, top_p=0.6, seed=3),
        dict(temperature=1.2, min_p=0.2, seed=4),
        dict(temperature=0.9, top_k=20, top_p=0.9, min_p=0.05, seed=5),
    ]
    prompts = [_prompt(4 + i, 20 + i) for i in range(len(mixes))]
    batches = [
        [SamplingParams(**m, max_tokens=6, ignore_eos=True) for m in mixes],
        [SamplingParams(**m, max_tokens=6, ignore_eos=True, logprobs=i % 3) for i, m in enumerate(mixes)],
    ]
    results, dtypes = {}, {}
    compute_logits = LlamaForCausalLM.compute_logits
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(LlamaForCausalLM, "compute_logits", lambda self, h: compute_logits(self, h).float())
        llm = tiny_llm_factory(dtype="bfloat16")
        llm.engine.runner.sampler.fused = True
        for i, params in enumerate(batches):
            fed.clear()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dtypes[forced, i] = set(fed)
            results[forced, i] = [
                (o.token_ids, [{t: (e.logprob, e.rank) for t, e in d.items()} for d in o.logprobs or []]) for o in outs
            ]
    assert dtypes == {
        (False, 0): {torch.bfloat16},
        (False, 1): {torch.float32},
        (True, 0): {torch.float32},
        (True, 1): {torch.float32},
    }
    assert results[False, 0] == results[True, 0] and results[False, 1] == results[True, 1]
    assert [tokens for tokens, _ in results[False, 0]] == [tokens for tokens, _ in results[False, 1]]
    assert all(len(lp) == 6 for _, lp in results[False, 1])
