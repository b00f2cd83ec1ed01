"""MoE models in the engine's features as dense models are: V2 selected, V1 == V2, prefix caching on == off,
greedy ngram speculation == none; the random-weight presets; config and checkpoint errors that name the problem.

The model is a tiny Qwen2-MoE HF checkpoint (shared expert, a dense layer, top-3 of 6 experts): its greedy
continuations depend on the context (`test_hf_parity_moe` checks them against HF).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import hf_greedy, hf_logits, random_prompts, save_tiny_checkpoint
from helpers.hf_moe_models import MOE_SPEC_BY_NAME
from safetensors.torch import load_file, save_file

from framework.engine.runner_selection import v2_unsupported_reasons
from framework.entrypoints.llm import LLM
from framework.layers.parallel.context import ParallelContext
from framework.models.hf_config import UnsupportedModelError
from framework.models.loader import CheckpointError, init_random_weights
from framework.models.moe import MoeForCausalLM
from framework.models.moe_config import MoeConfig
from framework.models.presets import preset_config
from framework.params.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, block_size=4, seed=0)
SHARED = random_prompts(1, 20, 20, seed=7)[0]
# Prompts sharing a 20-token prefix (5 blocks of 4), and repeating themselves (so ngram finds matches).
PROMPTS = [SHARED + tail + tail for tail in random_prompts(4, 3, 9, seed=8)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("moe-engine")
    save_tiny_checkpoint(MOE_SPEC_BY_NAME["qwen2moe-e6k3-shared"], path)
    return path


def _tokens(llm: LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def baseline(checkpoint: Path) -> list[list[int]]:
    return _tokens(LLM(str(checkpoint), **ENGINE, enable_prefix_caching=False))


def test_v2_serves_moe_and_v1_agrees(checkpoint: Path, baseline: list[list[int]]) -> None:
    v2 = LLM(str(checkpoint), **ENGINE, runner="v2", enable_prefix_caching=False)
    assert v2_unsupported_reasons(v2.config) == []
    assert isinstance(v2.engine.runner.model, MoeForCausalLM)
    assert _tokens(v2) == baseline
    assert _tokens(LLM(str(checkpoint), **ENGINE, runner="v1", enable_prefix_caching=False)) == baseline


def test_prefix_caching_on_equals_off(checkpoint: Path, baseline: list[list[int]]) -> None:
    llm = LLM(str(checkpoint), **ENGINE, enable_prefix_caching=True)
    first = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    rest = llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert [first.token_ids] + [o.token_ids for o in rest] == baseline
    assert all(o.num_cached_tokens >= 20 for o in rest), "the shared 20-token prefix should come from the cache"


def test_greedy_ngram_speculation_equals_none(checkpoint: Path, baseline: list[list[int]]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    llm = LLM(str(checkpoint), **ENGINE, enable_prefix_caching=False, speculative_config=spec)
    assert _tokens(llm) == baseline
    assert llm.get_metrics()["spec_decode"]["num_drafts"] > 0


def test_engine_with_the_triton_kernels_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine on the fused-MoE kernels (and every other Triton kernel, interpreted): greedy tokens of
    two batched prompts equal HF's."""
    import framework.layers.kernels.fused_moe as fused_moe_module

    hf = save_tiny_checkpoint(MOE_SPEC_BY_NAME["qwen3moe-e8k2-norm-tied"], tmp_path)
    calls: list[int] = []
    kernel = fused_moe_module.fused_moe_triton
    monkeypatch.setattr(fused_moe_module, "fused_moe_triton", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    prompts = random_prompts(2, 5, 12, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64, kernel_backend="triton")
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert calls, "the MoE layers did not run the Triton kernels"
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def test_random_weight_presets() -> None:
    """`qwen3-moe-tiny` runs with random weights; `qwen3-30b-a3b` has Qwen3-30B-A3B's geometry."""
    out = LLM("qwen3-moe-tiny", device="cpu").generate([[1, 2, 3, 4]], GREEDY, use_tqdm=False)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    big = MoeConfig.from_hf(preset_config("qwen3-30b-a3b"))
    assert (big.num_layers, big.hidden_size, big.num_experts, big.num_experts_per_tok) == (48, 2048, 128, 8)
    assert (big.moe_intermediate_size, big.num_heads, big.num_kv_heads, big.norm_topk_prob) == (768, 32, 4, True)
    assert all(big.is_sparse_layer(i) for i in range(48))
    with torch.device("meta"):
        params = sum(p.numel() for p in MoeForCausalLM(big).parameters())
    assert 30.0e9 < params < 31.0e9  # 30.5B: 61 GB in bf16, one H200


def test_random_weights_of_a_tensor_rank_are_a_slice_of_the_whole() -> None:
    """A tensor-parallel rank's random experts are its slice of the single-process ones (same intermediate
    columns of gate and of up, same down columns)."""
    cfg = MoeConfig.from_hf(preset_config("qwen3-moe-tiny"))
    whole, rank1 = MoeForCausalLM(cfg), MoeForCausalLM(cfg, ParallelContext(tp_size=2, rank=1))
    init_random_weights(whole, seed=3)
    init_random_weights(rank1, seed=3)
    ours, full = rank1.model.layers[0].mlp.experts, whole.model.layers[0].mlp.experts
    assert torch.equal(ours.gate_up_proj, full.gate_up_proj[:, :, 24:])
    assert torch.equal(ours.down_proj, full.down_proj[:, :, 24:])
    assert torch.equal(rank1.model.layers[0].mlp.gate.weight, whole.model.layers[0].mlp.gate.weight)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be between 1 and the number of experts"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size must be set"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
    ],
)
def test_bad_moe_configs_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        MoeConfig.from_hf({**preset_config("qwen3-moe-tiny"), **change})


def test_sparse_layers_follow_hf_rule() -> None:
    cfg = MoeConfig.from_hf(
        {**preset_config("qwen3-moe-tiny"), "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert [cfg.is_sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("arch", ["qwen3moe-e8k2-norm-tied", "mixtral-e6k2"])
def test_fused_expert_layout_loads_too(arch: str, tmp_path: Path) -> None:
    """A checkpoint in HF v5's in-memory layout (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj`, Mixtral's
    router under `mlp`) loads into the same model: logits equal HF's."""
    hf = save_tiny_checkpoint(MOE_SPEC_BY_NAME[arch], tmp_path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]  # shares the embedding's storage (safetensors refuses aliases)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=64)
    recorded: list[torch.Tensor] = []
    model = llm.engine.runner.model
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(compute_logits(hidden)) or recorded[-1]
    prompt = PROMPTS[0]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    torch.testing.assert_close(recorded[0][0], hf_logits(hf, prompt)[-1], atol=1e-4, rtol=1e-5)


def test_checkpoint_missing_an_expert_or_misshaped(checkpoint: Path, tmp_path: Path) -> None:
    tensors = load_file(str(checkpoint / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    missing = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.experts.4.up_proj.weight"}
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lacks weights: model\.layers\.1\.mlp\.experts\.gate_up_proj"):
        LLM(str(tmp_path), device="cpu")
    bad = dict(tensors)
    bad["model.layers.1.mlp.experts.2.down_proj.weight"] = torch.zeros(64, 31)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        CheckpointError,
        match=r"experts\.2\.down_proj\.weight' has shape \(64, 31\), the model "
        r"expects \(64, 32\)",
    ):
        LLM(str(tmp_path), device="cpu")
    extra = dict(tensors)
    extra["model.layers.1.mlp.experts.6.down_proj.weight"] = torch.zeros(64, 32)  # a 7th expert of 6
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="matches no parameter"):
        LLM(str(tmp_path), device="cpu")
