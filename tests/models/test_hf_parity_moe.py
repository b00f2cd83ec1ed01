"""mrv2's MoE model code (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers, as `test_hf_parity` does for
the dense families: same tiny random checkpoints (`hf_moe_models`), same prompts and engine settings (plain,
preempting, chunked prefill, both).

- greedy tokens from `LLM.generate` equal HF `generate` token for token;
- every logits row mrv2 computes is close to HF's at the same position: fp32 on the CPU, atol 1e-4 / rtol 1e-5
  (`test_hf_parity`'s tolerance; the expert sums run in another order than HF's `index_add_`, measured max
  |diff| ~1e-5).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hf_models import hf_greedy, hf_logits, save_tiny_checkpoint
from helpers.hf_moe_models import MOE_SPEC_BY_NAME, MOE_SPECS
from test_hf_parity import (
    LOGITS_ATOL,
    LOGITS_RTOL,
    MAX_MODEL_LEN,
    MAX_TOKENS,
    PROMPTS,
    SCENARIOS,
    Mrv2Run,
    run_mrv2,
)

from framework.entrypoints.llm import LLM
from framework.models.moe import MoeForCausalLM
from framework.params.sampling_params import SamplingParams

# Every spec runs plain and with preemption + chunked prefill together; the first one also runs each alone.
CASES = [
    (spec.name, scenario)
    for n, spec in enumerate(MOE_SPECS)
    for scenario in (SCENARIOS if n == 0 else ("plain", "chunked_preempt"))
]


class ArchCache:
    """Per architecture, built on first use: checkpoint dir, HF model, HF greedy tokens, mrv2 runs by scenario."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.checkpoints: dict[str, tuple[Path, torch.nn.Module]] = {}
        self.hf_tokens: dict[str, list[list[int]]] = {}
        self.runs: dict[tuple[str, str], Mrv2Run] = {}

    def checkpoint(self, arch: str) -> tuple[Path, torch.nn.Module]:
        if arch not in self.checkpoints:
            path = self.factory.mktemp(f"hf-{arch}")
            self.checkpoints[arch] = (path, save_tiny_checkpoint(MOE_SPEC_BY_NAME[arch], path))
        return self.checkpoints[arch]

    def tokens(self, arch: str) -> list[list[int]]:
        if arch not in self.hf_tokens:
            self.hf_tokens[arch] = [hf_greedy(self.checkpoint(arch)[1], p, MAX_TOKENS) for p in PROMPTS]
        return self.hf_tokens[arch]

    def run(self, arch: str, scenario: str) -> Mrv2Run:
        if (arch, scenario) not in self.runs:
            self.runs[arch, scenario] = run_mrv2(self.checkpoint(arch)[0], PROMPTS, **SCENARIOS[scenario])
        return self.runs[arch, scenario]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> ArchCache:
    return ArchCache(tmp_path_factory)


@pytest.mark.parametrize("arch", list(MOE_SPEC_BY_NAME))
def test_reference_outputs_are_not_degenerate(cache: ArchCache, arch: str) -> None:
    hf_tokens = cache.tokens(arch)
    distinct = [len(set(t)) for t in hf_tokens]
    assert min(distinct) >= 4, f"distinct tokens per HF continuation: {distinct}"
    assert len({tuple(t) for t in hf_tokens}) == len(hf_tokens)


@pytest.mark.parametrize("arch", list(MOE_SPEC_BY_NAME))
def test_layers_follow_the_config(cache: ArchCache, arch: str) -> None:
    """mrv2 builds a MoE block exactly where HF does (decoder_sparse_step, mlp_only_layers), with the shared
    expert where HF has one, and the stacked experts hold HF's per-expert weights."""
    checkpoint = cache.checkpoint(arch)
    llm = LLM(str(checkpoint[0]), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    model = llm.engine.runner.model
    assert isinstance(model, MoeForCausalLM)
    hf_layers = checkpoint[1].model.layers
    for ours, theirs in zip(model.model.layers, hf_layers):
        hf_ffn = getattr(theirs, "mlp", None) or theirs.block_sparse_moe
        ffn = ours.mlp
        assert hasattr(ffn, "experts") == hasattr(hf_ffn, "experts")
        assert hasattr(ffn, "shared_expert_gate") == hasattr(hf_ffn, "shared_expert_gate")
        if hasattr(hf_ffn, "experts"):
            e, two_i, h = hf_ffn.experts.gate_up_proj.shape
            torch.testing.assert_close(ffn.experts.gate_up_proj, hf_ffn.experts.gate_up_proj.view(e, 2, -1, h))
            torch.testing.assert_close(ffn.experts.down_proj, hf_ffn.experts.down_proj)


@pytest.mark.parametrize("arch,scenario", CASES)
def test_greedy_tokens_match_hf(cache: ArchCache, arch: str, scenario: str) -> None:
    run = cache.run(arch, scenario)
    for i, (out, expected) in enumerate(zip(run.outputs, cache.tokens(arch))):
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        assert out.token_ids == expected, f"prompt {i}: tokens differ from HF"
    preemptions = sum(out.num_preemptions for out in run.outputs)
    assert (preemptions > 0) == ("preempt" in scenario)
    partial_prefills = sum(1 for i, seq_len, _ in run.logits if seq_len < len(PROMPTS[i]))
    assert (partial_prefills > 0) == ("chunked" in scenario)


@pytest.mark.parametrize("arch,scenario", CASES)
def test_logits_close_to_hf(cache: ArchCache, arch: str, scenario: str) -> None:
    hf_model = cache.checkpoint(arch)[1]
    run = cache.run(arch, scenario)
    for i, (prompt, out) in enumerate(zip(PROMPTS, run.outputs)):
        reference = hf_logits(hf_model, prompt + out.token_ids[:-1])
        rows = [(seq_len, row) for j, seq_len, row in run.logits if j == i]
        assert {s for s, _ in rows if s >= len(prompt)} == set(range(len(prompt), len(prompt) + MAX_TOKENS))
        for seq_len, row in rows:
            torch.testing.assert_close(
                row,
                reference[seq_len - 1],
                atol=LOGITS_ATOL,
                rtol=LOGITS_RTOL,
                msg=lambda m: f"prompt {i}, seq_len {seq_len}: {m}",
            )


@pytest.mark.parametrize("bug", ["swap_experts", "flip_norm_topk_prob"])
def test_comparison_detects_a_wrong_moe(bug: str, tmp_path: Path) -> None:
    """Negative controls: two experts' stacked weights swapped (a loader that misplaces experts), or the
    renormalisation flipped, must break logits parity."""
    spec = MOE_SPEC_BY_NAME["qwen3moe-e8k2-norm-tied"]
    hf_model = save_tiny_checkpoint(spec, tmp_path)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    model = llm.engine.runner.model
    for layer in model.model.layers:
        if bug == "swap_experts":
            layer.mlp.experts.gate_up_proj.data[[0, 1]] = layer.mlp.experts.gate_up_proj.data[[1, 0]].clone()
        else:
            layer.mlp.normalize = not layer.mlp.normalize
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits
    model.compute_logits = lambda hidden: recorded.append(compute_logits(hidden)) or recorded[-1]
    prompt = PROMPTS[-1]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert (recorded[0][0] - hf_logits(hf_model, prompt)[-1]).abs().max().item() > 100 * LOGITS_ATOL
