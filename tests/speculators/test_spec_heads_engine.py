"""EAGLE, EAGLE-3 and MTP in the engine: greedy output equals output without speculation, token for token,
and every draft the engine proposes equals the head's full-sequence forward over HF's hidden states.

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
from helpers.hf_models import SPEC_BY_NAME, build_hf_model, random_prompts, save_tiny_checkpoint
from safetensors.torch import load_file, save_file
from test_draft_heads import random_head

from framework.config.schema import load_config
from framework.entrypoints.llm import LLM
from framework.models.loader import read_hf_config
from framework.params.sampling_params import SamplingParams
from speculators.draft_heads import DraftHead, Eagle3Head, load_draft_head
from speculators.policy import DraftLengthPolicy

K = 3
MAX_TOKENS = 24
PROMPTS = random_prompts(4, 5, 30, seed=77)
TARGET_OF = {"eagle": "llama", "eagle3": "qwen3", "mtp": "qwen2"}  # untied / tied+qk-norm / qkv-bias targets
HEAD_KWARGS: dict[str, dict[str, Any]] = {
    "eagle": {},
    "eagle3": {"draft_vocab_size": 100, "aux_layer_ids": [1, 0, 1]},
    "mtp": {},
}
SCENARIOS: dict[str, dict[str, Any]] = {
    "plain": {},
    # 20 blocks of 4 tokens: 4 requests of up to 54 tokens must preempt; 8 tokens per step chunk the prompts.
    "chunked_preempt": {"cache": {"block_size": 4, "num_blocks": 20}, "scheduler": {"max_num_batched_tokens": 8}},
}
Drafts = list[tuple[int, int, list[int]]]  # (prompt index, history length when proposed, drafts)


@lru_cache(maxsize=None)
def target_dir(name: str, root: str) -> Path:
    path = Path(root) / name
    save_tiny_checkpoint(SPEC_BY_NAME[name], path)
    return path


def generate(
    target: Path,
    speculator: Optional[dict[str, Any]],
    scenario: dict[str, Any],
    drafts: Optional[Drafts] = None,
    policy: Optional[DraftLengthPolicy] = None,
) -> list[list[int]]:
    """Greedy outputs in prompt order; `drafts` collects every proposal of a row that sampled; `policy` replaces
    the engine's draft-length policy."""
    data: dict[str, Any] = {
        "model": {"path": str(target), "preset": None, "dtype": "float32", "max_model_len": 80},
        "device": "cpu",
        "seed": 0,
    }
    for section, values in scenario.items():
        data.setdefault(section, {}).update(values)
    if speculator is not None:
        data["speculator"] = speculator
    llm = LLM(config=load_config(data))
    if policy is not None:
        llm.engine.draft_policy = llm.engine.scheduler.draft_policy = policy
    if drafts is not None:
        _record_drafts(llm, drafts)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [o.token_ids for o in outs]


def _record_drafts(llm: LLM, drafts: Drafts) -> None:
    spec = llm.engine.runner.speculator
    propose = spec.propose

    def recording(inputs):  # type: ignore[no-untyped-def]
        proposal = propose(inputs)
        batch = inputs.batch
        slots = batch.idx_mapping.long()
        for row, request_id in enumerate(batch.request_ids):
            if int(inputs.num_sampled[row]):
                length = int(inputs.request_state.total_len[slots[row]])
                # The scheduler allocated ahead: the last draft step's KV position lies in the row's blocks.
                last = int(batch.positions[int(batch.query_start_loc[row + 1]) - 1 - int(inputs.num_rejected[row])])
                assert last + inputs.num_draft_tokens - 1 < int(inputs.kv_capacity[row]), (request_id, last)
                drafts.append((int(request_id.split("-")[1]), length, proposal.draft_token_ids[row].tolist()))
        return proposal

    spec.propose = recording


@torch.no_grad()
def reference_drafts(
    head: DraftHead, hf: torch.nn.Module, aux_ids: tuple[int, ...], seq: list[int], length: int, k: int
) -> list[int]:
    """Drafts from the first `length` tokens: the head's full forward over (token p+1, HF hidden p), then k - 1
    feedback steps."""
    states = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states  # [0] embeddings, [-1] after norm
    target = torch.cat([states[i] for i in aux_ids], -1)[0] if aux_ids else states[-1][0]
    if isinstance(head, Eagle3Head):
        target = head.fc(target)
    ids, hid, out = list(seq[1:length]), list(target[: length - 1]), []
    for _ in range(k):
        h = head(torch.tensor([ids]), torch.stack(hid)[None])[0, -1]
        out.append(int(head.draft_token_ids(h)))
        ids.append(out[-1])
        hid.append(h)
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("spec-heads"))


@pytest.fixture(scope="module")
def reference(root: str) -> dict[str, list[list[int]]]:
    """Greedy output without speculation, per target (one torch thread: faster for these tiny ops)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {name: generate(target_dir(name, root), None, {}) for name in sorted(set(TARGET_OF.values()))}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(TARGET_OF))
def test_greedy_equals_no_speculation(kind: str, scenario: str, root: str, reference: dict, one_thread: None) -> None:
    target = target_dir(TARGET_OF[kind], root)
    head_dir = Path(root) / f"{kind}-head"
    config = read_hf_config(target)
    if not head_dir.exists():
        random_head(kind, seed=1, target=config, **HEAD_KWARGS[kind]).save_pretrained(head_dir)
    spec = {"method": kind, "num_speculative_tokens": K, "model": str(head_dir)}
    drafts: Drafts = []
    outputs = generate(target, spec, SCENARIOS[scenario], drafts)
    assert outputs == reference[TARGET_OF[kind]]
    # Every proposal equals the full-sequence reference on the same history (sampled positions only).
    hf = build_hf_model(SPEC_BY_NAME[TARGET_OF[kind]])
    head = load_draft_head(head_dir, kind, config)
    head.share_target_weights(hf.model.embed_tokens.weight, hf.lm_head.weight)
    aux = head.aux_layer_ids(config["num_hidden_layers"]) or ()
    assert len(drafts) >= 40
    for index, length, proposed in drafts[::3]:
        seq = PROMPTS[index] + outputs[index]
        assert proposed == reference_drafts(head, hf, aux, seq, length, K), (index, length)


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


class _CyclingK(DraftLengthPolicy):
    """k from a fixed cycle, one per step."""

    def __init__(self, max_k: int, cycle: list[int]) -> None:
        super().__init__(max_k)
        self.cycle, self.steps = cycle, 0

    def choose(self, request_ids):  # type: ignore[no-untyped-def]
        self.steps += 1
        return self.cycle[self.steps % len(self.cycle)]


def test_dynamic_k_over_eagle(root: str, reference: dict, one_thread: None) -> None:
    """dynamic-k picks k = 0 at times: the head's KV must still follow every step (drafts stay exact). The k
    sequence comes from a policy that cycles through 0, 1, 2 (what DynamicK would pick on a random head depends
    on measured step times), so every k and every switch between them occurs."""
    target = target_dir("llama", root)
    config = read_hf_config(target)
    head_dir = Path(root) / "eagle-dynamic-head"
    random_head("eagle", seed=4, target=config).save_pretrained(head_dir)
    spec = {
        "method": "eagle",
        "dynamic_k": True,
        "num_speculative_tokens": 2,
        "model": str(head_dir),
        "dynamic": {"explore_every": 2},
    }
    drafts: Drafts = []
    outputs = generate(target, spec, SCENARIOS["chunked_preempt"], drafts, policy=_CyclingK(2, [0, 1, 2, 2, 1]))
    assert outputs == reference["llama"]
    hf = build_hf_model(SPEC_BY_NAME["llama"])
    head = load_draft_head(head_dir, "eagle", config)
    head.share_target_weights(hf.model.embed_tokens.weight, hf.lm_head.weight)
    ks = {len(d) for _, _, d in drafts}
    assert ks == {0, 1, 2}  # k = 0 steps ran the head's first pass too
    for index, length, proposed in [d for d in drafts if d[2]][::2]:
        seq = PROMPTS[index] + outputs[index]
        assert proposed == reference_drafts(head, hf, (), seq, length, len(proposed)), (index, length)
