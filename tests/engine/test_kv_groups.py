"""KV groups (docs/sliding-window.md#kv-memory): models mixing full and window layers keep only the blocks each
window still reads, on a tiny random Gemma 3 (two 8-token window layers, one full: three groups of one layer) and
a tiny random gpt-oss (window and full layers alternating: two groups of two layers), with 4-token blocks.

Claims: with `cache.kv_groups` on, every block a window group gives back is overwritten at once with large random
K/V, and greedy tokens still equal HF transformers' on prompts of 2.5-5 windows, under chunked prefill (8-token
chunks), preemption, decode steps replayed as graphs (the fake capturer) and prefix caching with ngram
speculation (a later request hits a shared prefix whose early window blocks were given back; drafts rejected);
a request of 40 + 32 tokens holds exactly one block per full group per position block plus what each window
group's window reads; every block is free after the requests end. Planted fault: a window group freeing one
block too many changes the outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch
from helpers.fake_graphs import StaticInputsCapturer
from helpers.graph_lockstep import record_replays
from helpers.hf_models import (
    TINY_GEMMA3_LAYERS,
    TINY_GEMMA3_WINDOW,
    TinySpec,
    hf_greedy,
    random_prompts,
    save_tiny_checkpoint,
)

from framework.engine.scheduler.kv_groups import GroupedKVCacheManager
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs
from framework.models.setup import blocks_per_request
from framework.params.sampling_params import SamplingParams

WINDOW, BLOCK, MAX_TOKENS, MAX_MODEL_LEN = TINY_GEMMA3_WINDOW, 4, 16, 96
SPECS = {
    "gemma3": TinySpec(
        "gemma3-groups",
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        {**TINY_GEMMA3_LAYERS, "initializer_range": 0.05},
        seed=7,
    ),
    "gpt_oss": TinySpec(
        "gpt-oss-groups",
        "GptOssForCausalLM",
        "GptOssConfig",
        {
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": WINDOW,
            "tie_word_embeddings": False,
        },
        seed=21,
    ),
}
GROUPS = {"gemma3": (0, WINDOW, WINDOW), "gpt_oss": (0, WINDOW)}  # each group's window (0: full)
PROMPTS = random_prompts(3, 20, 40, seed=55)
SHARED = PROMPTS[2][:28]  # 7 blocks: the prefix-caching prompts share it
PREFIXED = [SHARED + p[:6] for p in PROMPTS[:2]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=sorted(SPECS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, dict]:
    """(name, checkpoint, HF's greedy tokens per prompt)."""
    name = request.param
    path = tmp_path_factory.mktemp(f"hf-{name}-groups")
    hf_model = save_tiny_checkpoint(SPECS[name], path)
    tokens = {tuple(p): hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS + PREFIXED}
    assert min(len(set(t)) for t in tokens.values()) >= 4, "the tiny model's continuations should vary"
    return name, path, tokens


def _llm(path: Path, kv_groups: bool = True, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    base = {"device": "cpu", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": BLOCK}
    config = config_from_kwargs(str(path), {**base, "max_num_batched_tokens": 8, **kwargs})
    cache = config.cache.model_copy(update={"kv_groups": kv_groups})
    return LLM(config=config.model_copy(update={"cache": cache}))


def _poison_released_blocks(llm: LLM) -> list[int]:
    """Overwrite with large random K/V, in every KV tensor, every block whose last reference goes away while it
    caches no prefix, and every block handed out again (what another group's or request's KV does to it); a
    released block that caches a prefix keeps its KV until then, as the prefix cache promises. Returns a
    one-element count of poisoned blocks."""
    kv, caches, count = llm.engine.kv_cache, llm.engine.runner.kv_caches, [0]
    release, take, gen = kv._release_blocks, kv._take_free_blocks, torch.Generator().manual_seed(0)

    def poison(block: int) -> None:
        count[0] += 1
        for cache in caches:
            cache[:, block] = 10 * torch.randn(cache[:, block].shape, generator=gen)

    def poisoning_release(blocks: Sequence[int]) -> None:
        release(blocks)
        for block in blocks:
            if kv.ref_count(block) == 0 and kv._block_hash[block] is None:
                poison(block)

    def poisoning_take(num: int) -> list[int]:
        blocks = take(num)
        for block in blocks:
            poison(block)
        return blocks

    kv._release_blocks = poisoning_release  # type: ignore[method-assign]
    kv._take_free_blocks = poisoning_take  # type: ignore[method-assign]
    return count


def _preempt_at(llm: LLM, steps: tuple[int, ...]) -> list[int]:
    """Preempt the newest running request before the schedule of each of `steps`; returns a one-element count."""
    scheduler, step, count = llm.engine.scheduler, [0], [0]
    schedule = scheduler.schedule

    def preempting_schedule():  # type: ignore[no-untyped-def]
        step[0] += 1
        if step[0] in steps and scheduler.running:
            scheduler.preempt(scheduler.running[-1])
            count[0] += 1
        return schedule()

    scheduler.schedule = preempting_schedule  # type: ignore[method-assign]
    return count


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [out.token_ids for out in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_groups_match_hf_with_released_blocks_poisoned(model: tuple[str, Path, dict]) -> None:
    """Chunked prefill (8-token chunks), the newest request preempted at steps 3 and 9, decode steps replayed as
    graphs; prefix caching off, so every block given back is poisoned at once."""
    name, path, hf_tokens = model
    llm = _llm(path, max_num_seqs=2, enable_prefix_caching=False)
    kv = llm.engine.kv_cache
    assert isinstance(kv, GroupedKVCacheManager) and kv.group_windows == GROUPS[name]
    poisoned = _poison_released_blocks(llm)
    preemptions = _preempt_at(llm, (3, 9))
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    replays = record_replays(llm)
    assert _generate(llm, PROMPTS) == [hf_tokens[tuple(p)] for p in PROMPTS]
    assert poisoned[0] > 20 and preemptions[0] == 2
    step_graphs = llm.engine.runner.graphs.step_graphs  # full-step graphs, when on, take the decode steps
    full_step_replays = sum(g.num_replays for g in step_graphs.graphs.values()) if step_graphs else 0
    assert replays or full_step_replays, "no decode step replayed a graph"
    assert kv.num_free_blocks == kv.num_blocks  # every block back after the requests end
    kv.check_conservation()


def test_prefix_hits_need_only_the_window_blocks(model: tuple[str, Path, dict]) -> None:
    """The first request caches the shared prefix and its window groups give back its early blocks; the later
    one still hits the prefix (full groups: every block; window groups: the blocks its window reads). Under
    ngram speculation: rejected drafts recompute positions the window groups must still hold, and verification
    steps replay the forward graphs (the fake capturer; full-step graphs take plain decode steps elsewhere)."""
    _, path, hf_tokens = model
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = _llm(path, enable_prefix_caching=True, speculative_config=spec, max_num_seqs=2)
    poisoned = _poison_released_blocks(llm)
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    replays = record_replays(llm)
    assert _generate(llm, PREFIXED[:1]) == [hf_tokens[tuple(PREFIXED[0])]]
    first_poisoned = poisoned[0]
    out = llm.generate(PREFIXED[1:], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in out] == [hf_tokens[tuple(p)] for p in PREFIXED[1:]]
    assert first_poisoned > 0 and out[0].num_cached_tokens == 28  # all 7 shared blocks hit
    metrics = llm.engine.spec_metrics
    assert metrics.num_draft_tokens > metrics.num_accepted_tokens  # some drafts rejected
    assert any(tokens_per_row == 4 for _, _, tokens_per_row in replays), "no verification step replayed a graph"
    llm.engine.kv_cache.check_conservation()


def _held_while_decoding(llm: LLM, prompt: list[int], max_tokens: int) -> list[tuple[int, int, int]]:
    """(blocks held, position blocks, first position the window may still need) at every decode step."""
    scheduler, kv = llm.engine.scheduler, llm.engine.kv_cache
    schedule, seen = scheduler.schedule, []

    def recording_schedule():  # type: ignore[no-untyped-def]
        out = schedule()
        for rid, n, before in zip(out.scheduled_request_ids, out.num_scheduled_tokens, out.num_computed_tokens):
            if n == 1:  # a decode row: released behind `before - placeholders` (placeholders: tokens in flight)
                request = scheduler.requests[rid]
                first = before - (request.num_output_placeholders - 1)
                seen.append((kv.num_held_blocks(rid), len(kv.growth_views()[0][rid]), first))
        return out

    scheduler.schedule = recording_schedule  # type: ignore[method-assign]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return seen


def test_held_blocks_follow_the_window(model: tuple[str, Path, dict]) -> None:
    """40 + 32 tokens (9x the window): at every decode step the request holds exactly one block per full group
    per position block plus, per window group, the blocks from the one its window's first key is in; at the last
    step that is 18 + 3 (gpt-oss: 21 blocks of 2 layers, 42 / 72 of the 18 blocks of 4 layers one table holds)
    or 18 + 2 x 3 (Gemma 3: 24 blocks of one layer, 24 / 54 of 18 blocks of 3 layers)."""
    name, path, _ = model
    llm = _llm(path)
    seen = _held_while_decoding(llm, PROMPTS[2], 32)
    windows = GROUPS[name]
    assert len(seen) >= 30
    for held, position_blocks, first in seen:
        kept = [position_blocks - (max(first - w + 1, 0) // BLOCK if w else 0) for w in windows]
        assert held == sum(kept), (held, position_blocks, first)
    held, position_blocks, _ = seen[-1]
    assert position_blocks == 18 and held == 18 + (len(windows) - 1) * 3
    kv, layout = llm.engine.kv_cache, llm.engine.runner.kv_groups
    assert kv.num_free_blocks == kv.num_blocks
    # The most a request may hold (KV sizing's check): 24 per full group, ceil((8 - 1 + 8) / 4) + 1 per window group.
    assert blocks_per_request(llm.config, llm.engine.loaded) == 24 + (len(windows) - 1) * 5
    # KV memory in layer-blocks: a block id holds `num_tensors` layers; one table would hold every layer per block.
    layers = len(layout.layer_group)
    assert held * layout.num_tensors / (position_blocks * layers) == {"gemma3": 24 / 54, "gpt_oss": 42 / 72}[name]


@pytest.mark.parametrize("model", ["gemma3"], indirect=True)
def test_planted_fault_one_block_too_many_changes_outputs(model: tuple[str, Path, dict]) -> None:
    """Window groups freeing behind a window one block shorter than the model's, with freed blocks poisoned:
    the window still reads the block, so the outputs leave HF's (Gemma 3 only: one model shows it)."""
    _, path, hf_tokens = model
    llm = _llm(path, enable_prefix_caching=False)
    kv = llm.engine.kv_cache
    assert isinstance(kv, GroupedKVCacheManager)
    kv.group_windows = tuple(w - BLOCK if w else 0 for w in kv.group_windows)
    _poison_released_blocks(llm)
    assert _generate(llm, PROMPTS) != [hf_tokens[tuple(p)] for p in PROMPTS]


def test_profile_run_gives_each_group_its_blocks(model: tuple[str, Path, dict]) -> None:
    """The start-up profile step (run on a GPU before the KV cache is sized) hands its dummy requests one block id
    per KV group per block, as the grouped KV manager does; the engine still matches HF afterwards."""
    name, path, tokens = model
    llm = _llm(path)
    assert llm.engine.runner.kv_groups is not None
    assert llm.engine.runner.profile_run() == 0  # the CPU reports no peak, but runs the whole step
    llm.engine.runner.initialize_kv_cache(llm.engine.kv_cache.num_blocks)  # the profile step threw its cache away
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.token_ids) for o in outs] == [tokens[tuple(p)] for p in PROMPTS]
