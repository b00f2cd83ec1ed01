"""Qwen3.5 / Qwen3-Next (Gated DeltaNet hybrids) against HF transformers, on the hybrid recurrent state.

- per class (Qwen3.5 dense, Qwen3-Next with MoE, Qwen3.5-MoE) on a tiny random HF checkpoint: prompt logprobs
  within tolerance of HF's forward, and greedy tokens equal to HF `generate` (its PyTorch delta-rule fallbacks);
- greedy tokens equal HF plainly, with chunked prefill (7 tokens a step: chunk ends inside and across the delta
  rule's chunks), with preemption (state recomputed), with prefix-cache hits (state restored from snapshots,
  second wave continuing the first), under ngram speculation (state advanced by the accepted tokens only);
- a reused slot carries nothing of its previous owner, and the check fails when the reset is skipped;
- a checkpoint with vision-tower and MTP tensors loads its text model (the others are skipped);
- decode graphs (the fake capturer of tests/helpers/fake_graphs.py) equal eager step by step on `qwen3_5-tiny`:
  requests joining and leaving, preemption, ngram drafts (verification shapes), prefix-cache snapshots.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fake_graphs import EagerReplayCapturer
from helpers.gdn_models import QWEN3_5, QWEN3_5_MOE, QWEN3_NEXT, slow_decay_checkpoint
from helpers.graph_lockstep import (
    check_exercised,
    hybrid_scenarios,
    lockstep,
    record_preemptions,
    record_replays,
    record_snapshot_copies,
    workload,
)
from helpers.hf_models import TinySpec, hf_greedy, hf_logits, random_prompts

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams
from model_states.hybrid_recurrent import HybridRecurrentModelState

MAX_TOKENS = 12
MAX_MODEL_LEN = 64
PROMPTS = random_prompts(3, 6, 30, seed=5)
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    path = tmp_path_factory.mktemp("hf-qwen3_5")
    model = slow_decay_checkpoint(QWEN3_5, path)
    tokens = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    assert min(len(set(t)) for t in tokens) >= 4, "degenerate reference continuations"
    return path, tokens


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, **kwargs)


@pytest.mark.parametrize("spec", [QWEN3_5, QWEN3_NEXT, QWEN3_5_MOE], ids=lambda s: s.name)
def test_prompt_logprobs_and_greedy_match_hf(spec: TinySpec, tmp_path: Path) -> None:
    model = slow_decay_checkpoint(spec, tmp_path)
    prompt = PROMPTS[2]
    llm = _llm(tmp_path, max_num_batched_tokens=11)  # the prompt's prefill is cut into chunks
    assert isinstance(llm.engine.runner.model_state, HybridRecurrentModelState)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i > 0])
    ref = torch.log_softmax(hf_logits(model, prompt), dim=-1)[torch.arange(len(prompt) - 1), prompt[1:]]
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)
    assert out.token_ids == hf_greedy(model, prompt, MAX_TOKENS)


SCENARIOS: dict[str, dict] = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 7},
    # 16 blocks of 4 tokens hold one request of max_model_len: three requests must preempt.
    "chunked_preempt": {"block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 7},
    "v1_chunked": {"max_num_batched_tokens": 7, "runner": "v1"},
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_match_hf(qwen3_5, scenario: str) -> None:  # type: ignore[no-untyped-def]
    outputs = _llm(qwen3_5[0], **SCENARIOS[scenario]).generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == qwen3_5[1]
    assert (sum(o.num_preemptions for o in outputs) > 0) == ("preempt" in scenario)


def test_prefix_cache_hits_restore_the_state(qwen3_5) -> None:  # type: ignore[no-untyped-def]
    """Second wave: each first-wave prompt plus its continuation plus new tokens; the hits start from snapshots
    and the tokens equal a run without caching."""
    path, tokens = qwen3_5
    second = [p + t + [7, 8, 9] for p, t in zip(PROMPTS, tokens)]
    want = [o.token_ids for o in _llm(path, enable_prefix_caching=False).generate(second, GREEDY, use_tqdm=False)]
    llm = _llm(path, enable_prefix_caching=True, block_size=4, max_num_batched_tokens=7)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == tokens
    outs = llm.generate(second, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert sum(o.num_cached_tokens or 0 for o in outs) > 0, "no prefix-cache hit"


def test_speculative_decoding_keeps_greedy_tokens(qwen3_5) -> None:  # type: ignore[no-untyped-def]
    path, tokens = qwen3_5
    prompts = [p + p for p in PROMPTS]  # repetitive: ngram proposes drafts
    want = [o.token_ids for o in _llm(path).generate(prompts, GREEDY, use_tqdm=False)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    llm = _llm(path, speculative_config=ngram)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.spec_metrics.num_drafts > 0


def test_reused_slot_carries_no_state(qwen3_5) -> None:  # type: ignore[no-untyped-def]
    """One slot, two requests in turn; before the second, every slot's state is garbage."""
    path, tokens = qwen3_5
    llm = _llm(path, max_num_seqs=1, enable_prefix_caching=False)
    state = llm.engine.runner.model_state
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].token_ids == tokens[0]
    for slab in state.slabs:
        slab.fill_(30.0)
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].token_ids == tokens[1]

    # The same check fails when taking a slot does not reset it (so the test above can fail).
    reset = state.apply_staged_writes
    state.apply_staged_writes = lambda: state._starts.clear()  # type: ignore[method-assign]
    for slab in state.slabs:
        slab.fill_(30.0)
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].token_ids != tokens[1]
    state.apply_staged_writes = reset  # type: ignore[method-assign]


def test_multimodal_checkpoint_loads_its_text_model(qwen3_5, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A Qwen3.5 checkpoint laid out as the multimodal class saves it (text under `model.language_model.`,
    vision tower under `model.visual.`, MTP heads under `mtp.`) gives the same tokens as the text-only one."""
    import json

    from safetensors.torch import load_file, save_file

    src, tokens = qwen3_5
    weights = load_file(str(next(src.glob("*.safetensors"))))
    renamed = {
        k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v for k, v in weights.items()
    }
    renamed["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    text = json.loads((src / "config.json").read_text())
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text}
    (tmp_path / "config.json").write_text(json.dumps(config))
    outs = _llm(tmp_path).generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outs[0].token_ids == tokens[0]


GRAPH_SCENARIOS = hybrid_scenarios(block_size=4)
_GRAPH_LLM = {"device": "cpu", "dtype": "float32", "seed": 0, "max_num_seqs": 6, "max_model_len": 64}


@pytest.mark.parametrize("scenario", list(GRAPH_SCENARIOS))
def test_decode_graph_replay_equals_eager(scenario: str) -> None:
    kwargs = {**_GRAPH_LLM, "async_scheduling": True, **GRAPH_SCENARIOS[scenario]}
    eager, graphed = LLM("qwen3_5-tiny", **kwargs), LLM("qwen3_5-tiny", **kwargs)
    graphed.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    replays, snapshots = record_replays(graphed), record_snapshot_copies(graphed)
    preempted = record_preemptions(graphed)
    # (batch shapes differ between eager and padded replays: the projections round differently)
    tokens = lockstep(eager, graphed, workload(scenario), rtol=1e-4, atol=2e-5)
    check_exercised(scenario, eager, graphed, tokens, replays, snapshots, preempted)


def test_graph_padding_rows_on_a_real_slot_are_caught() -> None:
    """Negative control: padding rows that write slot 0 (a live request's) instead of the dummy slot."""
    kwargs = {**_GRAPH_LLM, "async_scheduling": True}
    eager, graphed = LLM("qwen3_5-tiny", **kwargs), LLM("qwen3_5-tiny", **kwargs)
    graphed.engine.runner.capture_cuda_graphs(EagerReplayCapturer())
    graphed.engine.runner.graphs.cuda_graphs.dummy_slot = 0
    with pytest.raises(AssertionError, match="Tensor-likes are not close|tokens differ"):
        lockstep(eager, graphed, workload("join_leave"), rtol=1e-4, atol=2e-5)


def test_config_reading_and_refusals() -> None:
    """Layer types from `full_attention_interval` or `layer_types`; options mrv2 cannot run are refused by name."""
    from framework.models.hf_config import UnsupportedModelError
    from framework.models.presets import preset_config
    from framework.models.qwen3_next import Qwen3NextConfig

    base = preset_config("qwen3_5-tiny")
    cfg = Qwen3NextConfig.from_hf(base)
    assert cfg.layer_types == ("linear_attention", "full_attention") * 2
    assert (cfg.rotary_dim, cfg.gdn.conv_dim, cfg.gdn.fused_projections) == (4, 2 * 2 * 16 + 4 * 16, False)
    moe = Qwen3NextConfig.from_hf(
        {**base, "architectures": ["Qwen3_5MoeForCausalLM"], "num_experts": 4, "norm_topk_prob": False}
    )
    assert moe.norm_topk_prob and all(moe.is_sparse(i) for i in range(4))  # HF: every layer, renormalised
    with pytest.raises(UnsupportedModelError, match="rope_type='yarn'"):
        Qwen3NextConfig.from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        Qwen3NextConfig.from_hf({**base, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    with pytest.raises(UnsupportedModelError, match="linear_num_value_heads=3"):
        Qwen3NextConfig.from_hf({**base, "linear_num_value_heads": 3})
