"""The offline API's own contract (`LLM.generate`, `LLM.generate_stream`): abandoned streams, and inputs of the
wrong type refused by name before anything is queued."""

from __future__ import annotations

import pytest

from framework import InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_an_abandoned_stream_frees_its_requests_and_generate_still_works(tiny_llm_factory):
    llm = tiny_llm_factory(max_num_seqs=2)
    alone = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids
    stream = llm.generate_stream([[1, 2, 3], [4, 5, 6]], GREEDY)
    first = next(stream)
    assert not first.finished
    stream.close()  # what `break` out of a for loop does once the generator is dropped
    assert llm.engine.is_idle()  # no request queued, no block or slot held
    for _ in llm.generate_stream([[1, 2, 3]], GREEDY):
        break  # dropped: CPython closes it at once
    assert llm.engine.is_idle()
    outs = llm.generate([[7, 8, 9], [7, 8, 9]], GREEDY, use_tqdm=False)  # every slot: none is held
    assert [o.token_ids for o in outs] == [alone, alone]
    assert llm.engine.is_idle()


def test_generate_returns_its_own_requests_while_another_caller_has_requests_in_flight(tiny_llm_factory):
    llm = tiny_llm_factory()
    alone = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)[0].token_ids
    llm.engine.add_request("other", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    outs = llm.generate([[7, 8, 9]], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [alone]


@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, "prompt 0 is None"),
        (5, "prompt 0 is 5"),
        ([[1, 2], None], "prompt 1 is None"),
        (["ok", 3.5], "prompt 1 is 3.5"),
    ],
)
def test_a_prompt_of_the_wrong_type_is_refused_by_name(tiny_llm, prompts, message):
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "params, message",
    [
        ([GREEDY, None], r"sampling_params\[1\] is None, not a SamplingParams"),
        ({"temperature": 0.0}, r"sampling_params is a dict, not a SamplingParams or a list of them"),
    ],
)
def test_sampling_params_of_the_wrong_type_are_refused_by_name(tiny_llm, params, message):
    with pytest.raises(InvalidRequestError, match=message):
        tiny_llm.generate([[1, 2], [3, 4]], params, use_tqdm=False)
    assert not tiny_llm.engine.has_unfinished_requests()
    assert tiny_llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].finish_reason == "length"


def test_vllm_prompt_dicts_are_text_and_token_prompts(tiny_llm):
    """vLLM's TextPrompt `{"prompt": text}` and TokensPrompt `{"prompt_token_ids": ids}` (its way of passing ids)
    are the text and the ids they hold, not audio prompts."""
    plain = tiny_llm.generate(["abc", [5, 6, 7]], GREEDY, use_tqdm=False)
    wrapped = tiny_llm.generate([{"prompt": "abc"}, {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in wrapped] == [o.token_ids for o in plain]
    assert wrapped[0].prompt == "abc" and wrapped[1].prompt_token_ids == [5, 6, 7]
    one = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in one] == [plain[1].token_ids]
    with pytest.raises(InvalidRequestError, match="audio prompts need an encoder-decoder model"):
        tiny_llm.generate([{"prompt": "abc", "audio": None}], GREEDY, use_tqdm=False)


def test_max_tokens_none_generates_what_the_context_leaves(tiny_llm_factory):
    """vLLM's `max_tokens=None`: up to `max_model_len` minus the prompt, then `length`; the same tokens as asking
    for exactly that many. min_tokens is checked against it only when it is a number."""
    llm = tiny_llm_factory(max_model_len=64)
    prompts = [[5, 6, 7], list(range(1, 41))]
    outs = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, min_tokens=30), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        assert len(out.token_ids) == 64 - len(prompt) and out.finish_reason == "length"
        exact = llm.generate(
            [prompt], SamplingParams(temperature=0.0, max_tokens=64 - len(prompt), ignore_eos=True), use_tqdm=False
        )[0]
        assert exact.token_ids == out.token_ids
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert llm.engine.is_idle()


def test_token_ids_as_numpy_arrays_and_torch_tensors(tiny_llm_factory):
    """Token ids from numpy or torch (a 1-D array: one prompt; 2-D: one per row; or inside a list) are the ids they
    hold; before, their scalars were refused as 'outside the vocabulary'."""
    import numpy as np
    import torch

    llm = tiny_llm_factory()
    rows = [[5, 6, 7, 8], [9, 10, 11, 12]]
    want = [o.token_ids for o in llm.generate(rows, GREEDY, use_tqdm=False)]
    for prompts in (np.array(rows), torch.tensor(rows), [np.array(rows[0]), torch.tensor(rows[1])]):
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.generate(np.array(rows[0], dtype=np.int32), GREEDY, use_tqdm=False)[0].token_ids == want[0]
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.generate([np.array([1.5, 2.0])], GREEDY, use_tqdm=False)  # float ids stay refused


@pytest.mark.parametrize(
    "model, message",
    [
        ("/missing/dir", "the model directory '/missing/dir' does not exist"),
        ("./not-here", "the model directory './not-here' does not exist"),
        ("Qwen/Qwen3-0.6B", "looks like a Hugging Face Hub id: mrv2 never downloads models"),
        ("tinyy", "unknown model.preset 'tinyy'; embedded presets: .*random_tiny"),
    ],
)
def test_a_model_that_is_not_there_is_named_for_what_it_looks_like(model, message):
    from pathlib import Path

    from framework import LLM
    from framework.config.schema import ConfigError
    from framework.models.presets import OFFLINE_RECIPE

    with pytest.raises(ConfigError, match=message) as refused:
        LLM(model, device="cpu")
    if "/" in model and not model.startswith((".", "/")):  # the Hub-id message points to a recipe that exists
        page, heading = OFFLINE_RECIPE.split(", ")
        assert OFFLINE_RECIPE in str(refused.value)
        docs = Path(__file__).resolve().parents[2] / page
        assert f"## {heading.strip(chr(39))}" in docs.read_text()
