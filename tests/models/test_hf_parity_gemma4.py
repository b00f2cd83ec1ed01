"""mrv2's Gemma 4 text model (`Gemma4ForCausalLM`) against HF transformers on tiny random checkpoints.

Two checkpoints, each with 8-token windows on its sliding layers, a final logit soft-cap of 30, tied embeddings,
full layers of their own head_dim (32, the window layers 16) with a `proportional` RoPE turning part of the pairs,
and every `layer_scalar` (and router scale) randomised:
- "ple": 5 layers (window, window, full, window, full); the last two share the keys and values of layers 1 and 2
  (`num_kv_shared_layers` 2: 3 KV caches for 5 layers), per-layer input embeddings (8 per layer), double-wide
  MLPs on the shared layers;
- "moe": 3 layers, `attention_k_eq_v` on the full layer (one KV head there, values from the key projection) and a
  4-expert top-2 MoE beside every MLP.

Prompts of 22..40 tokens (up to 5x the window), 32 output tokens, chunked prefill (8 tokens a step: chunk
boundaries inside and across the window) and preemption: greedy tokens equal HF `generate`, every logits row within
atol 1e-4 / rtol 1e-5 of HF's. A `Gemma4ForConditionalGeneration` checkpoint (tiny vision and audio towers) with
the same text weights loads its text part (towers skipped, logged once) and matches HF's, media placeholder tokens
in the prompt included. Prefix caching with decode graphs (the fake capturer), and KV groups with every block given
back poisoned, give HF's tokens. Planted faults: a shared layer reading the first layer of its kind instead of the
last, and the full layers' RoPE turning every pair, each break the logits parity.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
import transformers
from helpers.fake_graphs import StaticInputsCapturer
from helpers.graph_lockstep import record_replays
from helpers.hf_models import TinySpec, build_hf_model, hf_greedy, hf_logits
from test_hf_parity import LOGITS_ATOL, LOGITS_RTOL, MAX_MODEL_LEN, MAX_TOKENS, PROMPTS, SCENARIOS, run_mrv2

from framework.config.schema import ConfigError
from framework.entrypoints.llm import LLM
from framework.entrypoints.llm_config import config_from_kwargs
from framework.models.gemma4_config import Gemma4Config
from framework.models.hf_config import UnsupportedModelError
from framework.params.sampling_params import SamplingParams

S, F = "sliding_attention", "full_attention"
WINDOW = 8
COMMON = {
    "num_key_value_heads": 2,
    "head_dim": 16,
    "global_head_dim": 32,
    "sliding_window": WINDOW,
    "final_logit_softcapping": 30.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.05,  # tied embeddings scaled by sqrt(hidden): 0.2 makes greedy repeat one token
    "pad_token_id": 0,
}
SPECS = {
    "ple": TinySpec(
        "gemma4-ple",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        {
            **COMMON,
            "num_hidden_layers": 5,
            "layer_types": [S, S, F, S, F],
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            "vocab_size_per_layer_input": 256,
            "use_double_wide_mlp": True,
            "rope_parameters": {
                S: {"rope_type": "default", "rope_theta": 50.0},
                F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1000.0},
            },
        },
        seed=7,
    ),
    "moe": TinySpec(
        "gemma4-moe",
        "Gemma4ForCausalLM",
        "Gemma4TextConfig",
        {
            **COMMON,
            "num_hidden_layers": 3,
            "layer_types": [S, S, F],
            "attention_k_eq_v": True,
            "num_global_key_value_heads": 1,
            "hidden_size_per_layer_input": 0,
            "enable_moe_block": True,
            "num_experts": 4,
            "top_k_experts": 2,
            "moe_intermediate_size": 32,
            "rope_parameters": {
                S: {"rope_type": "default", "rope_theta": 50.0},
                F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000.0},
            },
        },
        seed=7,
    ),
}
PROMPTS3 = PROMPTS[2:]  # 22, 31 and 40 tokens: 3 to 5 windows


def save_gemma4_checkpoint(spec: TinySpec, path: Path) -> torch.nn.Module:
    """`spec`'s HF model with its layer scalars and router scales randomised too (HF sets them to one, where a
    missing or misplaced one would not show), saved as safetensors under `path`."""
    model = build_hf_model(spec)
    gen = torch.Generator().manual_seed(spec.seed + 2000)
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("layer_scalar", "router.scale", "router.per_expert_scale")):
                tensor.copy_(0.5 + torch.rand(tensor.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=sorted(SPECS))
def checkpoint(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(f"hf-gemma4-{request.param}")
    return path, save_gemma4_checkpoint(SPECS[request.param], path)


@pytest.fixture(scope="module")
def ple_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("hf-gemma4-ple-only")
    return path, save_gemma4_checkpoint(SPECS["ple"], path)


def _check_logits(hf_model: torch.nn.Module, run, prompts: list[list[int]] = PROMPTS3) -> float:  # type: ignore[no-untyped-def]
    """The largest |logits - HF's| over every row mrv2 computed (asserting each is within tolerance)."""
    worst = 0.0
    for i, (prompt, out) in enumerate(zip(prompts, run.outputs)):
        reference = hf_logits(hf_model, prompt + out.token_ids[:-1])
        for j, seq_len, row in run.logits:
            if j == i:
                worst = max(worst, (row - reference[seq_len - 1]).abs().max().item())
                torch.testing.assert_close(row, reference[seq_len - 1], atol=LOGITS_ATOL, rtol=LOGITS_RTOL)
    return worst


def test_config_reads_the_geometry_hf_builds(ple_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Layer kinds, head geometry per kind, KV sources and RoPE frequencies as HF's model has them."""
    path, hf_model = ple_checkpoint
    hf = json.loads((path / "config.json").read_text())
    cfg = Gemma4Config.from_hf(hf)
    assert [cfg.layer_window(i) for i in range(5)] == [WINDOW, WINDOW, 0, WINDOW, 0]
    assert cfg.kv_sources == (0, 1, 2, 1, 2) and cfg.kv_layers == (0, 1, 2)
    assert [cfg.layer_geometry(i) for i in (0, 2)] == [(2, 16), (2, 32)] and cfg.kv_row_width() == (2, 32)
    assert [cfg.layer_intermediate_size(i) for i in range(5)] == [128, 128, 128, 256, 256]
    rotary = hf_model.model.rotary_emb
    for kind in (S, F):
        assert torch.equal(cfg.kind_inv_freq(kind), getattr(rotary, f"{kind}_inv_freq"))
    assert (cfg.kind_inv_freq(F)[8:] == 0).all() and (cfg.kind_inv_freq(F)[:8] > 0).all()  # 16 of 32 dims turn
    # A config.json without `per_layer_config` (as released): `global_head_dim`, else HF's 512.
    legacy = {k: v for k, v in hf.items() if k != "per_layer_config"}
    assert Gemma4Config.from_hf({**legacy, "global_head_dim": 32}).full_head_dim == 32
    assert Gemma4Config.from_hf(legacy).full_head_dim == 512
    k_eq_v = Gemma4Config.from_hf({**legacy, "attention_k_eq_v": True, "num_global_key_value_heads": 1})
    assert k_eq_v.layer_geometry(2) == (1, 512) and k_eq_v.layer_k_eq_v(2) and not k_eq_v.layer_k_eq_v(1)
    all_window = {**legacy, "layer_types": [S] * 5, "num_kv_shared_layers": 0}
    assert Gemma4Config.from_hf(all_window).layer_types[-1] == F  # HF forces it


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"hidden_activation": "silu"}, "hidden_activation='silu'"),
        ({"rope_parameters": {S: {"rope_type": "yarn", "factor": 2.0}, F: {}}}, "rope_type='yarn'"),
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers=5"),
        ({"num_kv_shared_layers": 3}, "shared layer 2 .full_attention. has no earlier full_attention layer"),
        ({"per_layer_config": {"2": {"intermediate_size": 64}}}, r"overrides \['intermediate_size'\]"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5}, "top_k_experts=5"),
    ],
)
def test_config_refuses_what_mrv2_cannot_run(ple_checkpoint, override, message) -> None:  # type: ignore[no-untyped-def]
    hf = json.loads((ple_checkpoint[0] / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match=message):
        Gemma4Config.from_hf({**hf, **override})


def test_greedy_and_logits_match_hf_chunked_preempt(checkpoint) -> None:  # type: ignore[no-untyped-def]
    path, hf_model = checkpoint
    hf_tokens = [hf_greedy(hf_model, p, MAX_TOKENS) for p in PROMPTS3]
    assert min(len(set(t)) for t in hf_tokens) >= 4, "the tiny model's continuations should vary"
    run = run_mrv2(path, PROMPTS3, **SCENARIOS["chunked_preempt"])
    assert [out.token_ids for out in run.outputs] == hf_tokens
    assert sum(out.num_preemptions for out in run.outputs) > 0
    assert any(seq_len < len(PROMPTS3[i]) for i, seq_len, _ in run.logits), "no prefill was chunked"
    print(f"max |logits diff|: {_check_logits(hf_model, run):.2e}")


def test_multimodal_checkpoint_loads_its_text_model(ple_checkpoint, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """A Gemma4ForConditionalGeneration checkpoint (vision and audio towers, text weights under
    `model.language_model.`) gives HF's tokens and logits on a prompt holding its image / audio / video
    placeholder ids (which HF's text path embeds as padding); the skipped tower tensors are logged once."""
    text_config = ple_checkpoint[1].config.to_dict()
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    audio = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "output_proj_dims": 16}
    config = transformers.Gemma4Config(
        text_config=text_config,
        vision_config={**vision, "num_key_value_heads": 2, "head_dim": 8},
        audio_config={**audio, "subsampling_conv_channels": [4, 4]},
        image_token_id=250,
        audio_token_id=251,
        video_token_id=252,
    )
    multimodal = transformers.Gemma4ForConditionalGeneration(config).eval()
    multimodal.model.language_model.load_state_dict(ple_checkpoint[1].model.state_dict())
    multimodal.save_pretrained(tmp_path, safe_serialization=True)
    prompt = PROMPTS[-1][:10] + [250, 251, 252] + PROMPTS[-1][10:20]
    with caplog.at_level(logging.INFO, logger="framework.models.gemma4"):
        run = run_mrv2(tmp_path, [prompt])
    assert run.outputs[0].token_ids == hf_greedy(multimodal, prompt, MAX_TOKENS)
    _check_logits(multimodal, run, [prompt])
    assert sum("skipping the checkpoint's vision / audio towers" in r.getMessage() for r in caplog.records) == 1


def _plant_wrong_kv_source(patch: pytest.MonkeyPatch) -> None:
    """Shared layer 3 attends over layer 0's keys and values (the first window layer, not the last one before the
    shared tail)."""
    from_hf = Gemma4Config.from_hf.__func__  # type: ignore[attr-defined]

    def first_of_kind(cls, cfg):  # type: ignore[no-untyped-def]
        return dataclasses.replace(from_hf(cls, cfg), kv_sources=(0, 1, 2, 0, 2))

    patch.setattr(Gemma4Config, "from_hf", classmethod(first_of_kind))


def _plant_every_pair_turns(patch: pytest.MonkeyPatch) -> None:
    """The full layers' proportional RoPE turns every pair (`partial_rotary_factor` ignored)."""
    kind_inv_freq = Gemma4Config.kind_inv_freq

    def every_pair(self, kind):  # type: ignore[no-untyped-def]
        if kind != F:
            return kind_inv_freq(self, kind)
        return 1.0 / (1000.0 ** (torch.arange(0, self.full_head_dim, 2, dtype=torch.float) / self.full_head_dim))

    patch.setattr(Gemma4Config, "kind_inv_freq", every_pair)


def test_negative_controls(ple_checkpoint, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The logits match HF's, and leave them with each fault planted: a shared layer reading the wrong source
    layer's KV cache; the full layers' RoPE turning every pair."""
    path, hf_model = ple_checkpoint
    prompts = PROMPTS[-1:]
    _check_logits(hf_model, run_mrv2(path, prompts), prompts)
    for plant in (_plant_wrong_kv_source, _plant_every_pair_turns):
        with monkeypatch.context() as patch:
            plant(patch)
            with pytest.raises(AssertionError):
                _check_logits(hf_model, run_mrv2(path, prompts), prompts)


def test_prefix_caching_and_decode_graphs(ple_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """Prompts sharing a 24-token prefix (3 windows) through the prefix cache, decode steps replayed as graphs."""
    path, hf_model = ple_checkpoint
    shared = PROMPTS[-1][:24]
    prompts = [shared + p[:6] for p in PROMPTS[:3]]
    expected = [hf_greedy(hf_model, p, 12) for p in prompts]
    llm = LLM(
        str(path),
        device="cpu",
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        seed=0,
        block_size=4,
        enable_prefix_caching=True,
        max_num_seqs=2,  # fewer decode graphs to capture
    )
    llm.engine.runner.capture_cuda_graphs(StaticInputsCapturer())
    replays = record_replays(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens >= 20 for o in rest), "the shared prefix should come from the cache"
    step_graphs = llm.engine.runner.graphs.step_graphs  # full-step graphs, when on, take the decode steps
    full_step_replays = sum(g.num_replays for g in step_graphs.graphs.values()) if step_graphs else 0
    assert replays or full_step_replays, "no decode step replayed a graph"


def test_kv_groups_with_released_blocks_poisoned(ple_checkpoint) -> None:  # type: ignore[no-untyped-def]
    """`cache.kv_groups`: the 3 KV layers (the shared layers have none) form a full group and two window groups
    of one layer; with every block a window group gives back overwritten at once, chunked prefill gives HF's
    tokens (the shared layers read their source layer's group)."""
    from test_kv_groups import _poison_released_blocks

    path, hf_model = ple_checkpoint
    base = {"device": "cpu", "dtype": "float32", "max_model_len": MAX_MODEL_LEN, "block_size": 4}
    config = config_from_kwargs(str(path), {**base, "max_num_batched_tokens": 8, "enable_prefix_caching": False})
    llm = LLM(config=config.model_copy(update={"cache": config.cache.model_copy(update={"kv_groups": True})}))
    assert llm.engine.kv_cache.group_windows == (0, WINDOW, WINDOW)
    poisoned = _poison_released_blocks(llm)
    prompts = PROMPTS3[1:]  # 31 and 40 tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, p, 12) for p in prompts]
    assert poisoned[0] > 10


def test_lora_is_refused_by_name(ple_checkpoint) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match="Gemma4ForCausalLM does not take LoRA adapters"):
        LLM(str(ple_checkpoint[0]), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN, enable_lora=True)
