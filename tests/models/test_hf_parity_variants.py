"""mrv2 against HF transformers on the config.json variants real checkpoints carry (docs/getting-started.md,
"Checkpoint variants"): each is run, or refused at load with an error naming the key, never silently ignored.

Each variant is a tiny random HF model (`hf_models`); a 90-token prompt runs past Llama 3's
`original_max_position_embeddings` (32 here) and every other length the variant cares about. Compared: the
logprob of every prompt token (`prompt_logprobs`) and the greedy continuation, against HF's forward and generate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import transformers
from helpers.hf_models import TinySpec, build_hf_model, hf_greedy, hf_logits, random_prompts

from framework.entrypoints.llm import LLM
from framework.models.hf_config import UnsupportedModelError
from framework.models.loader import CheckpointError
from framework.params.sampling_params import SamplingParams

PROMPT = random_prompts(1, 90, 90, seed=7)[0]
NEW_TOKENS = 8
MAX_MODEL_LEN = 128
LOGPROB_ATOL = 1e-4  # fp32 on the CPU: measured max |diff| ~1e-5 (summation order only)

_LLAMA = {"num_key_value_heads": 2, "tie_word_embeddings": False}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

VARIANTS: list[TinySpec] = [
    # Llama 3.1 rope scaling (factor 8) with Llama 3's theta, prompt past original_max_position_embeddings.
    TinySpec("llama31-rope", "LlamaForCausalLM", "LlamaConfig", {**_LLAMA, "rope_parameters": _LLAMA3_ROPE}, 21),
    TinySpec(
        "linear-rope",
        "LlamaForCausalLM",
        "LlamaConfig",
        {**_LLAMA, "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
        22,
    ),
    # Llama 3.2: tied embeddings and llama3 scaling together.
    TinySpec(
        "llama32-tied",
        "LlamaForCausalLM",
        "LlamaConfig",
        {**_LLAMA, "tie_word_embeddings": True, "rope_parameters": {**_LLAMA3_ROPE, "factor": 32.0}},
        23,
    ),
    # Biases everywhere, head_dim * heads (128) != hidden (64), a large norm eps.
    TinySpec(
        "llama-biases-headdim-eps",
        "LlamaForCausalLM",
        "LlamaConfig",
        {**_LLAMA, "attention_bias": True, "mlp_bias": True, "head_dim": 32, "rms_norm_eps": 1e-2},
        24,
    ),
    # Qwen2 with sliding-window attention configured off (its real checkpoints): full attention over 90 tokens.
    TinySpec(
        "qwen2-window-off",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        {**_LLAMA, "use_sliding_window": False, "sliding_window": 16, "rope_theta": 1e6},
        25,
    ),
    # Mistral with a window larger than max_model_len (v0.1's 4096): nothing slides, it runs.
    TinySpec("mistral-window-4096", "MistralForCausalLM", "MistralConfig", {**_LLAMA, "sliding_window": 4096}, 26),
]


def _save(spec: TinySpec, path: Path, edit: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
    build_hf_model(spec).save_pretrained(path)
    if edit is not None:
        cfg = json.loads((path / "config.json").read_text())
        edit(cfg)
        (path / "config.json").write_text(json.dumps(cfg))


def _assert_matches_hf(path: Path, hf_model: torch.nn.Module) -> None:
    """Prompt logprobs within fp32 tolerance and the same greedy tokens as HF."""
    llm = LLM(str(path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    reference = torch.log_softmax(hf_logits(hf_model, PROMPT), dim=-1)
    ours = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(PROMPT) if i > 0])
    theirs = torch.stack([reference[i - 1, t] for i, t in enumerate(PROMPT) if i > 0])
    worst = (ours - theirs).abs().max().item()
    assert worst < LOGPROB_ATOL, f"max |prompt logprob diff| {worst:.2e}"
    assert out.token_ids == hf_greedy(hf_model, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("spec", VARIANTS, ids=lambda s: s.name)
def test_variant_matches_hf(spec: TinySpec, tmp_path: Path) -> None:
    _save(spec, tmp_path)
    _assert_matches_hf(tmp_path, build_hf_model(spec))


def _drop(*keys: str) -> Callable[[dict[str, Any]], None]:
    return lambda cfg: [cfg.pop(k, None) for k in keys]  # type: ignore[func-returns-value]


@pytest.mark.parametrize(
    "name,spec,edit",
    [
        # Qwen3Config assumes head_dim 128 when config.json leaves it out (not hidden / heads = 16 here).
        (
            "qwen3-no-head_dim",
            TinySpec(
                "q3", "Qwen3ForCausalLM", "Qwen3Config", {**_LLAMA, "head_dim": 128, "use_sliding_window": False}, 27
            ),
            _drop("head_dim"),
        ),
        # MixtralConfig assumes rope_theta 1e6 and rms_norm_eps 1e-5.
        (
            "mixtral-no-theta-eps",
            TinySpec(
                "mx",
                "MixtralForCausalLM",
                "MixtralConfig",
                {
                    **_LLAMA,
                    "num_local_experts": 4,
                    "num_experts_per_tok": 2,
                    "sliding_window": None,
                    "rms_norm_eps": 1e-5,
                    "rope_theta": 1e6,
                },
                28,
            ),
            _drop("rope_parameters", "rope_theta", "rms_norm_eps"),
        ),
    ],
)
def test_missing_keys_take_hf_class_defaults(name: str, spec: TinySpec, edit: Callable, tmp_path: Path) -> None:
    """A config.json without a key means what HF's config class of that architecture assumes for it."""
    _save(spec, tmp_path, edit)
    hf_model = getattr(transformers, spec.architecture).from_pretrained(tmp_path).eval()  # reads the edited file
    _assert_matches_hf(tmp_path, hf_model)


@pytest.mark.parametrize(
    "name,kwargs,error,words",
    [
        (
            "yarn",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
            UnsupportedModelError,
            "rope_type='yarn'",
        ),
        (
            "dynamic",
            {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
            UnsupportedModelError,
            "rope_type='dynamic'",
        ),
        ("gelu", {"hidden_act": "gelu_pytorch_tanh"}, UnsupportedModelError, "hidden_act='gelu_pytorch_tanh'"),
    ],
)
def test_unsupported_options_are_refused_by_name(
    name: str, kwargs: dict, error: type, words: str, tmp_path: Path
) -> None:
    _save(TinySpec(name, "LlamaForCausalLM", "LlamaConfig", {**_LLAMA, **kwargs}, 29), tmp_path)
    with pytest.raises(error, match=words):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)


@pytest.mark.parametrize(
    "arch,config,kwargs",
    [
        ("MistralForCausalLM", "MistralConfig", {"sliding_window": 32}),
        ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}),
    ],
)
def test_sliding_window_below_max_model_len_runs(arch: str, config: str, kwargs: dict, tmp_path: Path) -> None:
    """A window of 32 keys under a 90-token prompt: the windowed layers (every Mistral layer; Qwen2's from
    `max_window_layers` on) attend through it, as HF does."""
    spec = TinySpec(arch, arch, config, {**_LLAMA, **kwargs}, 30)
    _save(spec, tmp_path)
    _assert_matches_hf(tmp_path, getattr(transformers, arch).from_pretrained(tmp_path).eval())


def test_tied_config_with_a_separate_lm_head_is_refused(tmp_path: Path) -> None:
    """tie_word_embeddings=true over a checkpoint whose lm_head.weight differs from the embedding: copying one
    over the other changed both uses of the weight (transformers 5 keeps them apart); refused by name."""
    _save(
        TinySpec("untied", "LlamaForCausalLM", "LlamaConfig", _LLAMA, 31),
        tmp_path,
        lambda cfg: cfg.update(tie_word_embeddings=True),
    )
    with pytest.raises(CheckpointError, match="lm_head.weight.*differ.*tie_word_embeddings"):
        LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)


def test_tied_config_with_an_equal_lm_head_loads(tmp_path: Path) -> None:
    """Exporters that write the tied LM head as well (equal values) still load, and match HF."""
    spec = TinySpec("tied", "LlamaForCausalLM", "LlamaConfig", {**_LLAMA, "tie_word_embeddings": True}, 32)
    hf_model = build_hf_model(spec)
    state = {k: v.clone() for k, v in hf_model.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    hf_model.save_pretrained(tmp_path, state_dict=state)
    from safetensors import safe_open

    with safe_open(str(next(tmp_path.glob("*.safetensors"))), framework="pt") as f:
        assert "lm_head.weight" in f.keys(), "the test needs a checkpoint holding both tensors"
    _assert_matches_hf(tmp_path, hf_model)


def test_every_eos_id_of_a_list_ends_a_request_as_in_hf(tmp_path: Path) -> None:
    """generation_config.json's `eos_token_id` as a list (Llama 3.x Instruct): HF's generate stops at any of them,
    and so does mrv2 (the first is eos; the others become stop tokens, reported as `stop_reason`); with
    ignore_eos none of them stops it."""
    spec = TinySpec("eos-list", "LlamaForCausalLM", "LlamaConfig", _LLAMA, 32)
    hf_model = build_hf_model(spec)
    hf_model.save_pretrained(tmp_path)
    free = hf_greedy(hf_model, PROMPT, NEW_TOKENS)
    stop_at = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    eos_ids = [hf_model.vocab_size - 1 if stop_at != hf_model.vocab_size - 1 else 0, stop_at]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    ids = torch.tensor([PROMPT])
    want = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
    )[0, len(PROMPT) :].tolist()
    assert want == free[: free.index(stop_at) + 1]  # HF stops at the list's second id
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_model_len=MAX_MODEL_LEN)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)[0]
    assert out.token_ids == want and out.finish_reason == "stop" and out.stop_reason == stop_at
    free_run = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False
    )[0]
    assert free_run.token_ids == free
