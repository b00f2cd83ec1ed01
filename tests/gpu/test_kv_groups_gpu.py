"""KV groups on a GPU (skipped without CUDA; docs/sliding-window.md#models-mixing-window-and-full-layers-kv-groups):
the tiny random Gemma 3 and gpt-oss of tests/engine/test_kv_groups.py through the Triton kernels and real decode
CUDA graphs, every block given back overwritten at once with large random K/V, greedy tokens equal to HF's
(float32); and the `gemma-3-4b` geometry with groups holding, while decoding 3,000-token prompts, one block per
position block in its full group plus at most 65 per window group.

Run: `python3 -m pytest -q tests/gpu/test_kv_groups_gpu.py`
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["gemma3", "gpt_oss"])
def test_groups_match_hf_on_gpu_with_released_blocks_poisoned(tmp_path, name):
    from helpers.hf_models import hf_greedy, random_prompts, save_tiny_checkpoint
    from test_kv_groups import SPECS, _llm, _poison_released_blocks

    from framework import SamplingParams
    from framework.engine.scheduler.kv_groups import GroupedKVCacheManager

    hf = save_tiny_checkpoint(SPECS[name], tmp_path).to("cuda", torch.float32)
    prompts = random_prompts(6, 20, 60, seed=3)  # 2.5 to 7.5 windows of 8
    llm = _llm(tmp_path, device="cuda", gpu_memory_utilization=0.3, max_num_batched_tokens=16, max_model_len=128)
    assert isinstance(llm.engine.kv_cache, GroupedKVCacheManager)
    poisoned = _poison_released_blocks(llm)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    with torch.device("cuda"):
        assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]
    assert poisoned[0] > 20 and llm.engine.runner.graphs.cuda_graphs is not None


def test_gemma_3_4b_geometry_holds_the_window_blocks_only():
    from test_kv_groups import _held_while_decoding

    from framework.entrypoints.llm import LLM
    from framework.entrypoints.llm_config import config_from_kwargs
    from framework.models.setup import kv_bytes_per_block

    config = config_from_kwargs(
        "gemma-3-4b", {"device": "cuda", "dtype": "bfloat16", "max_model_len": 4096, "gpu_memory_utilization": 0.5}
    )
    llm = LLM(config=config.model_copy(update={"cache": config.cache.model_copy(update={"kv_groups": True})}))
    layout = llm.engine.runner.kv_groups
    assert layout is not None and layout.num_tensors == 5 and layout.group_windows == (0,) + (1024,) * 6
    per_block = kv_bytes_per_block(llm.engine.loaded, config.cache.block_size)
    prompt = [(7 * j) % 256 for j in range(3000)]
    seen = _held_while_decoding(llm, prompt, 16)
    for held, position_blocks, _ in seen:
        assert held <= position_blocks + 6 * (-(-1024 // 16) + 1)
    held, position_blocks, _ = seen[-1]
    grouped = held * per_block  # a block id holds 5 layers
    every_layer = position_blocks * per_block // 5 * 34  # one table: every block holds all 34 layers
    assert 2 * grouped < every_layer
