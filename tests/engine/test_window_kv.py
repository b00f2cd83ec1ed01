"""KV memory that follows a sliding window (docs/sliding-window.md#kv-memory), on a tiny random Mistral whose three
layers attend through a 6-token window, with 4-token blocks.

Claims: a request gives back the blocks that fell out of its window, so a long one holds at most
ceil(window / block_size) + 1 blocks while decoding; outputs with that on equal outputs with it off and HF
transformers' greedy tokens on prompts 3-7x the window, plain, under chunked prefill, preemption, ngram
speculation (drafts rejected), on the V1 runner and with prefix caching (a hit needs only the blocks the window
still reads); released blocks poisoned at once leave the outputs unchanged. Planted fault: freeing one block too
many (a window one block shorter than the model's) with the same poisoning changes the outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch
from helpers.hf_models import TinySpec, hf_greedy, random_prompts, save_tiny_checkpoint

from framework.engine.scheduler.kv_cache_manager import NO_BLOCK, KVCacheManager, window_hit
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs
from framework.params.sampling_params import SamplingParams

WINDOW, BLOCK = 6, 4  # a window that is not a whole number of blocks: blocks fall out between allocations
MAX_TOKENS, MAX_MODEL_LEN = 16, 96
SPEC = TinySpec(
    "mistral-window",
    "MistralForCausalLM",
    "MistralConfig",
    {"num_hidden_layers": 3, "num_key_value_heads": 2, "sliding_window": WINDOW, "tie_word_embeddings": False},
    seed=41,
)
PROMPTS = random_prompts(3, 20, 40, seed=55)
SHARED = PROMPTS[2][:28]  # a 28-token prefix (7 blocks) the prefix-caching prompts share
PREFIXED = [SHARED + p[:6] for p in PROMPTS[:2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

SCENARIOS = {  # plain runs: `test_held_blocks_stay_within_the_window`
    "chunked": {"max_num_batched_tokens": 8},
    # The newest running request is preempted at steps 3 and 9 (`_preempt_at`): it recomputes its tokens.
    "chunked_preempt": {"max_num_batched_tokens": 8},
    # Drafts verified and rejected: released blocks stop short of the positions a rejection recomputes.
    "ngram": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}},
    "v1_chunked": {"runner": "v1", "max_num_batched_tokens": 8},
}
PREEMPT_AT = (3, 9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("hf-mistral-window")
    return path, save_tiny_checkpoint(SPEC, path)


@pytest.fixture(scope="module")
def hf_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> dict[tuple[int, ...], list[int]]:
    model = checkpoint[1]
    tokens = {tuple(p): hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS + PREFIXED}
    assert min(len(set(t)) for t in tokens.values()) >= 4, "the tiny model's continuations should vary"
    return tokens


def _llm(path: Path, free_window_blocks: bool = True, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    config = config_from_kwargs(
        str(path), {"device": "cpu", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK, **kwargs}
    )
    cache = config.cache.model_copy(update={"free_window_blocks": free_window_blocks})
    return LLM(config=config.model_copy(update={"cache": cache}))


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _preempt_at(llm: LLM, steps: tuple[int, ...]) -> list[int]:
    """Preempt the newest running request before the schedule of each of `steps` (as the step-failure policy
    does); returns a one-element list counting the preemptions made."""
    scheduler, count, step = llm.engine.scheduler, [0], [0]
    schedule = scheduler.schedule

    def preempting_schedule():  # type: ignore[no-untyped-def]
        step[0] += 1
        if step[0] in steps and scheduler.running:
            scheduler.preempt(scheduler.running[-1])
            count[0] += 1
        return schedule()

    scheduler.schedule = preempting_schedule  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_freeing_matches_hf(scenario: str, checkpoint: tuple[Path, torch.nn.Module], hf_tokens: dict) -> None:
    llm = _llm(checkpoint[0], **SCENARIOS[scenario])
    assert llm.engine.kv_cache.window == WINDOW
    preemptions = _preempt_at(llm, PREEMPT_AT if "preempt" in scenario else ())
    assert _generate(llm, PROMPTS) == [hf_tokens[tuple(p)] for p in PROMPTS]
    assert preemptions[0] == (len(PREEMPT_AT) if "preempt" in scenario else 0)
    spec = llm.engine.spec_metrics
    assert (spec.num_draft_tokens > spec.num_accepted_tokens) == (scenario == "ngram")  # some drafts rejected
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks  # every block back after the requests end
    kv.check_conservation()


def test_prefix_hits_read_only_the_window(checkpoint: tuple[Path, torch.nn.Module], hf_tokens: dict) -> None:
    """The first request caches the shared prefix and gives back its early blocks as its window moves on; the
    others still hit it (the hit needs only the blocks the window of its first computed token reads)."""
    llm = _llm(checkpoint[0], enable_prefix_caching=True, max_num_batched_tokens=8)
    assert _generate(llm, PREFIXED[:1]) == [hf_tokens[tuple(PREFIXED[0])]]
    assert _generate(llm, PREFIXED[1:]) == [hf_tokens[tuple(p)] for p in PREFIXED[1:]]
    assert llm.prefix_cache_stats.hits >= 24  # the later prompt read >= 6 of the 7 shared blocks
    llm.engine.kv_cache.check_conservation()


def test_held_blocks_stay_within_the_window(checkpoint: tuple[Path, torch.nn.Module]) -> None:
    """A 40-token prompt and 48 output tokens (15x the window): while decoding it holds at most
    ceil(6 / 4) + 1 = 3 blocks; without freeing it ends holding 22, with the same output."""
    prompt, params = PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    held: dict[bool, list[int]] = {}
    outputs = []
    for free in (True, False):
        llm = _llm(checkpoint[0], free_window_blocks=free)
        scheduler, kv, counts = llm.engine.scheduler, llm.engine.kv_cache, held.setdefault(free, [])
        schedule = scheduler.schedule

        def recording_schedule():  # type: ignore[no-untyped-def]
            out = schedule()
            for rid, n in zip(out.scheduled_request_ids, out.num_scheduled_tokens):
                if n == 1:  # a decode row
                    counts.append(kv.num_held_blocks(rid))
            return out

        scheduler.schedule = recording_schedule  # type: ignore[method-assign]
        outputs.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        assert kv.num_free_blocks == kv.num_blocks
    assert len(held[True]) >= 40 and max(held[True]) == -(-WINDOW // BLOCK) + 1
    assert max(held[False]) == -(-(40 + 48) // BLOCK)
    assert outputs[0] == outputs[1]  # freeing on == off


def _poison_released_blocks(llm: LLM) -> list[int]:
    """Overwrite every block whose last reference goes away with large random K/V in every layer (what another
    request's KV would do once the block is handed out again); returns a one-element count of poisoned blocks."""
    kv, caches, count = llm.engine.kv_cache, llm.engine.runner.kv_caches, [0]
    release, gen = kv._release_blocks, torch.Generator().manual_seed(0)

    def poisoning_release(blocks: Sequence[int]) -> None:
        release(blocks)
        for block in blocks:
            if kv.ref_count(block) == 0:
                count[0] += 1
                for cache in caches:
                    cache[:, block] = 10 * torch.randn(cache[:, block].shape, generator=gen)

    kv._release_blocks = poisoning_release  # type: ignore[method-assign]
    return count


@pytest.mark.parametrize("planted", [False, True], ids=["freed-blocks-unread", "planted-one-block-too-many"])
def test_released_blocks_are_never_read(
    planted: bool, checkpoint: tuple[Path, torch.nn.Module], hf_tokens: dict
) -> None:
    """Released blocks are poisoned at once: the outputs still equal HF's, so no kernel reads a block that fell
    out of the window. Planted fault: free behind a window one block shorter than the model's; the window still
    reads the block, and the outputs leave HF's."""
    llm = _llm(checkpoint[0], max_num_batched_tokens=8)
    poisoned = _poison_released_blocks(llm)
    if planted:
        llm.engine.kv_cache.window = WINDOW - BLOCK
    matches = _generate(llm, PROMPTS) == [hf_tokens[tuple(p)] for p in PROMPTS]
    assert poisoned[0] > 10 and matches != planted


# ---- the hit rule without a model ---------------------------------------------------------------------------
def test_window_hit_needs_only_the_blocks_the_window_reads() -> None:
    kv = KVCacheManager(16, BLOCK, enable_prefix_caching=True, window=WINDOW)
    # A hit of n blocks computes from position 4n, whose window reads positions 4n - 5 .. 4n - 1: blocks n-2, n-1.
    assert window_hit([None, None, 5, 6, 7], kv) == [NO_BLOCK, NO_BLOCK, NO_BLOCK, 6, 7]
    assert window_hit([1, 2, None, 6, None], kv) == [1, 2]  # blocks 3 of a 4-block hit: block 2 is missing
    assert window_hit([None, 9], kv) == []  # a 2-block hit reads block 0 too
    assert window_hit([3, None, None], kv) == [3]
    full = KVCacheManager(16, BLOCK, enable_prefix_caching=True, window=3 * BLOCK + 2)  # reads 4 blocks back
    assert window_hit([None, 1, 2, 3, 4], full) == [NO_BLOCK, 1, 2, 3, 4]
