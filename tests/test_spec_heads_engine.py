"""EAGLE, EAGLE-3 and MTP in the engine: greedy output equals output without speculation, token for token.

Targets are the HF-parity tiny checkpoints; heads have random weights (saved, then loaded through
`speculator.model`, or for MTP also from inside the target's own checkpoint). Scenarios: plain, and a KV
cache small enough to preempt with a token budget small enough to chunk prefills (mixed prefill/decode).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from framework.config import load_config
from framework.llm import LLM
from framework.models.loader import read_hf_config
from framework.sampling_params import SamplingParams

try:
    from hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint
except ImportError:  # tests/ collected as a package
    from tests.hf_models import SPEC_BY_NAME, random_prompts, save_tiny_checkpoint
from tests.test_draft_heads import random_head

MAX_TOKENS = 24
PROMPTS = random_prompts(4, 5, 30, seed=77)
TARGET_OF = {"eagle": "llama", "eagle3": "qwen3", "mtp": "qwen2"}  # untied / tied+qk-norm / qkv-bias targets
HEAD_KWARGS: dict[str, dict[str, Any]] = {"eagle": {}, "eagle3": {"draft_vocab_size": 100, "aux_layer_ids": [1, 0, 1]},
                                          "mtp": {}}
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    # 20 blocks of 4 tokens: 4 requests of up to 54 tokens must preempt; 8 tokens per step chunk the prompts.
    "chunked_preempt": {"cache": {"block_size": 4, "num_blocks": 20}, "scheduler": {"max_num_batched_tokens": 8}},
}


@lru_cache(maxsize=None)
def target_dir(name: str, root: str) -> Path:
    path = Path(root) / name
    save_tiny_checkpoint(SPEC_BY_NAME[name], path)
    return path


def generate(target: Path, speculator: Optional[dict[str, Any]], scenario: dict[str, Any]) -> list[list[int]]:
    data: dict[str, Any] = {"model": {"path": str(target), "preset": None, "dtype": "float32", "max_model_len": 80},
                            "device": "cpu", "seed": 0}
    for section, values in scenario.items():
        data.setdefault(section, {}).update(values)
    if speculator is not None:
        data["speculator"] = speculator
    llm = LLM(config=load_config(data))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("spec-heads"))


@pytest.fixture(scope="module")
def reference(root: str) -> dict[str, list[list[int]]]:
    """Greedy output without speculation, per target."""
    return {name: generate(target_dir(name, root), None, {}) for name in set(TARGET_OF.values())}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(TARGET_OF))
def test_greedy_equals_no_speculation(kind: str, scenario: str, root: str, reference: dict, one_thread: None) -> None:
    target = target_dir(TARGET_OF[kind], root)
    head_dir = Path(root) / f"{kind}-head"
    if not head_dir.exists():
        random_head(kind, seed=1, target=read_hf_config(target), **HEAD_KWARGS[kind]).save_pretrained(head_dir)
    spec = {"method": kind, "num_speculative_tokens": 3, "model": str(head_dir)}
    assert generate(target, spec, SCENARIOS[scenario]) == reference[TARGET_OF[kind]]


def test_mtp_layers_inside_the_target_checkpoint(root: str, reference: dict, tmp_path: Path, one_thread: None) -> None:
    """MTP read from model.path: the target loader skips the MTP tensors, the speculator reads only them."""
    source = target_dir("qwen2", root)
    target = tmp_path / "with-mtp"
    target.mkdir()
    config = read_hf_config(source)
    head = random_head("mtp", seed=2, target=config)
    (target / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    tensors = {**load_file(str(source / "model.safetensors")), **head.state_dict()}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    assert generate(target, spec, {}) == reference["qwen2"]
    with pytest.raises(Exception, match="needs speculator.model, or a target checkpoint"):
        generate(source, spec, {})
