"""Jamba (Mamba-hybrid) against HF transformers, and the per-slot recurrent state of MambaHybridModelState.

- greedy tokens from `LLM.generate` equal HF `generate` on a tiny random Jamba checkpoint, plainly, with
  preemption (recurrent state recomputed from scratch), with chunked prefill (the scan continues from the
  slot's state), both, and under the V1 runner;
- a reused slot carries nothing of its previous owner (its state is poisoned before the new request), and the
  check fails when the reset is skipped;
- with drafts, the state advances by the accepted tokens only (tail buffers + `postprocess`);
- selection: Jamba configs get the hybrid state, the model class names it, `model.model_state` overrides.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.hf_models import TinySpec, build_hf_model, hf_greedy, random_prompts

from framework.entrypoints.llm import LLM
from framework.models.interface import MambaHybrid
from framework.models.mamba_layer import MambaMixer, MambaStepInputs
from framework.params.sampling_params import SamplingParams
from model_states.mamba_hybrid import MambaHybridModelState

MAX_TOKENS = 16
MAX_MODEL_LEN = 64
PROMPTS = random_prompts(3, 5, 30, seed=77)
# 4 layers: mamba, attention, mamba, attention; dense MLPs (one expert); d_inner 128, d_state 8, d_conv 4.
JAMBA = TinySpec(
    "jamba",
    "JambaForCausalLM",
    "JambaConfig",
    {
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "num_experts": 1,
        "expert_layer_period": 1,
        "expert_layer_offset": 0,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "mamba_d_state": 8,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_dt_rank": 8,
        "tie_word_embeddings": False,
    },
    seed=11,
)

SCENARIOS: dict[str, dict] = {
    "plain": {},
    # 16 blocks of 4 tokens hold one request of max_model_len: three requests must preempt.
    "preempt": {"block_size": 4, "num_kv_blocks": 16},
    # 7 tokens per step: prompts of 8..30 tokens are prefilled in chunks, resumed prefills too.
    "chunked_preempt": {"block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 7},
    "v1_chunked_preempt": {"block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 7, "runner": "v1"},
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


# The tiny models' many tiny ops run faster on one thread of a small shared CPU (conftest's `one_thread`).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("hf-jamba")
    model = build_hf_model(JAMBA)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


@pytest.fixture(scope="module")
def hf_tokens(checkpoint: tuple[Path, torch.nn.Module]) -> list[list[int]]:
    tokens = [hf_greedy(checkpoint[1], p, MAX_TOKENS) for p in PROMPTS]
    assert min(len(set(t)) for t in tokens) >= 4, "degenerate reference continuations"
    return tokens


def _llm(path: Path, **kwargs) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, seed=0, **kwargs)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_match_hf(checkpoint, hf_tokens, scenario: str) -> None:  # type: ignore[no-untyped-def]
    llm = _llm(checkpoint[0], **SCENARIOS[scenario])
    assert isinstance(llm.engine.runner.model_state, MambaHybridModelState)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_tokens
    preemptions = sum(o.num_preemptions for o in outputs)
    assert (preemptions > 0) == ("preempt" in scenario), preemptions


def test_reused_slot_carries_no_state(checkpoint, hf_tokens) -> None:  # type: ignore[no-untyped-def]
    """One slot, two requests in turn; before the second, every slot's state is filled with garbage."""
    llm = _llm(checkpoint[0], max_num_seqs=1)
    state = llm.engine.runner.model_state
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[0]
    state.conv_state.fill_(3.0)
    state.ssm_state.fill_(-5.0)
    assert llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].token_ids == hf_tokens[1]

    # The same check fails when taking a slot does not reset it (so the test above can fail).
    reset = state.apply_staged_writes
    state.apply_staged_writes = lambda: state._starts.clear()  # type: ignore[method-assign]
    state.ssm_state.fill_(-5.0)
    out = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0]
    assert out.finish_reason == "length" and out.token_ids != hf_tokens[1]
    state.apply_staged_writes = reset  # type: ignore[method-assign]


class _OneMixer(torch.nn.Module, MambaHybrid):
    """The smallest model MambaHybridModelState accepts: one Mamba mixer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.mixer = MambaMixer(16, 24, 6, 4, 4, 1e-6, conv_bias=True, proj_bias=False)
        with torch.no_grad():
            for p in self.mixer.parameters():
                p.copy_(0.3 * torch.randn_like(p))

    def mamba_state_shapes(self):  # type: ignore[no-untyped-def]
        return 1, (24, 3), (24, 6)


def _batch(slots: list[int], lens: list[int], drafts: list[int]) -> SimpleNamespace:
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    return SimpleNamespace(
        num_rows=len(slots),
        num_tokens=sum(lens),
        num_draft_host=np.array(drafts),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        query_start_loc=qsl,
    )


def _run(state: MambaHybridModelState, model: _OneMixer, x: torch.Tensor, batch: SimpleNamespace) -> torch.Tensor:
    step: MambaStepInputs = state.prepare_inputs(batch)["mamba"]  # type: ignore[assignment]
    return model.mixer(x, step.layers[0], step)


@torch.no_grad()
def test_drafts_advance_state_by_accepted_tokens_only() -> None:
    """Rows verifying 3 drafts with 0..3 rejected end where a run of only the accepted tokens ends."""
    model = _OneMixer()
    prompt, step_tokens = torch.randn(5, 16), torch.randn(4, 16)  # the last sampled token + 3 drafts
    state = MambaHybridModelState(model, {}, 8, torch.device("cpu"))
    slots = [1, 6, 3, 0]
    for s in slots:
        state.add_request(s, SimpleNamespace(num_computed_tokens=0, request_id=str(s), snapshot_slot=None))
    state.apply_staged_writes()
    for s in slots:  # the same 5-token prefill in every slot
        _run(state, model, prompt, _batch([s], [5], [0]))
    after_prompt = (state.conv_state.clone(), state.ssm_state.clone())
    rejected = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    batch = _batch(slots, [4, 4, 4, 4], [3, 3, 3, 3])
    _run(state, model, step_tokens.repeat(4, 1), batch)
    state.postprocess(batch, 4 - rejected, rejected)

    for row, s in enumerate(slots):
        ref = MambaHybridModelState(model, {}, 8, torch.device("cpu"))
        ref.conv_state.copy_(after_prompt[0])
        ref.ssm_state.copy_(after_prompt[1])
        accepted = 4 - int(rejected[row])
        _run(ref, model, step_tokens[:accepted], _batch([s], [accepted], [0]))
        torch.testing.assert_close(state.conv_state[:, s], ref.conv_state[:, s])
        torch.testing.assert_close(state.ssm_state[:, s], ref.ssm_state[:, s], atol=1e-6, rtol=1e-5)
    assert not torch.equal(state.ssm_state[:, slots[0]], state.ssm_state[:, slots[3]])


def test_selection(checkpoint) -> None:  # type: ignore[no-untyped-def]
    from framework.config.registry import MODELS
    from framework.models.loader import read_hf_config
    from model_states import detect_model_state_name, select_model_state
    from model_states.default import DefaultModelState

    hf_config = read_hf_config(checkpoint[0])
    jamba_cls = MODELS.get("JambaForCausalLM")
    assert detect_model_state_name(object.__new__(jamba_cls), hf_config) == "mamba_hybrid"  # the class names it
    assert detect_model_state_name(torch.nn.Module(), hf_config) == "mamba_hybrid"  # the config's shape does
    assert select_model_state(torch.nn.Module(), hf_config, None) is MambaHybridModelState
    assert select_model_state(torch.nn.Module(), hf_config, "default") is DefaultModelState  # override wins


def test_presets_and_unsupported_configs() -> None:
    """The jamba-tiny preset runs (V2 = V1 under seeded sampling); jamba-1024 has Jamba's block structure;
    mixture-of-experts configs are refused by name."""
    from framework.models.hf_config import UnsupportedModelError
    from framework.models.jamba import JambaConfig
    from framework.models.presets import preset_config

    params = SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True)
    prompts = [[(3 * i + j) % 250 for j in range(4 + 5 * i)] for i in range(4)]
    outs = [
        [
            o.token_ids
            for o in LLM("jamba-tiny", device="cpu", runner=r, max_num_batched_tokens=9).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for r in ("v2", "v1")
    ]
    assert outs[0] == outs[1] and all(len(t) == 12 for t in outs[0])

    big = JambaConfig.from_hf(preset_config("jamba-1024"))
    assert [i for i in range(big.num_layers) if big.is_attention(i)] == [4, 12]
    assert (big.d_inner, big.d_state, big.d_conv, big.dt_rank) == (2048, 16, 4, 64)
    with pytest.raises(UnsupportedModelError, match="num_experts=16"):
        JambaConfig.from_hf({**preset_config("jamba-tiny"), "num_experts": 16})
