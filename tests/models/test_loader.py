"""Checkpoint loading: sharded safetensors, tokenizer.json, and the checkpoints mrv2 refuses."""

from __future__ import annotations

import json
import re

import pytest
import torch

from framework import LLM, SamplingParams
from framework.models import CheckpointError


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=1,
    )
    path = tmp_path_factory.mktemp("qwen3")
    Qwen3ForCausalLM(cfg).save_pretrained(path, max_shard_size="20KB")  # several shards + index
    return path


def _greedy(path, prompt=(5, 6, 7, 8)) -> list[int]:
    llm = LLM(str(path), device="cpu", dtype="float32")
    return llm.generate([list(prompt)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids


def test_sharded_checkpoint_loads(qwen3_dir):
    assert (qwen3_dir / "model.safetensors.index.json").is_file()
    assert len(list(qwen3_dir.glob("*.safetensors"))) > 1
    assert len(_greedy(qwen3_dir)) == 8


def test_tokenizer_json_is_used(qwen3_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    for f in qwen3_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    vocab = {w: i for i, w in enumerate(["<unk>", "</s>"] + [f"w{i}" for i in range(94)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = LLM(str(tmp_path), device="cpu", dtype="float32")
    assert llm.tokenizer.encode("w3 w4 w5") == [5, 6, 7]
    out = llm.generate(["w3 w4 w5 w6"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == _greedy(qwen3_dir)
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="has no config.json"):
        LLM(str(tmp_path), device="cpu")


def test_pickle_only_checkpoint_is_refused(qwen3_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(CheckpointError, match=r"only as pickle \(pytorch_model.bin\); mrv2 never unpickles"):
        LLM(str(tmp_path), device="cpu")


def test_corrupt_safetensors(qwen3_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(CheckpointError, match="is not a readable safetensors file"):
        LLM(str(tmp_path), device="cpu")


def test_missing_shard_and_missing_weights(qwen3_dir, tmp_path):
    (tmp_path / "config.json").write_text((qwen3_dir / "config.json").read_text())
    index = json.loads((qwen3_dir / "model.safetensors.index.json").read_text())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing shards listed in model.safetensors.index.json"):
        LLM(str(tmp_path), device="cpu")
    from safetensors.torch import save_file

    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"model.norm.weight": torch.ones(32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="lacks weights: lm_head.weight|lacks weights: model.embed_tokens"):
        LLM(str(tmp_path), device="cpu")


def test_unsupported_architecture(qwen3_dir, tmp_path):
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        CheckpointError,
        match="architecture .GPT2LMHeadModel. is not supported; registered: Gemma3ForCausalLM, Gemma4ForCausalLM, Gpt",
    ):
        LLM(str(tmp_path), device="cpu")


def test_checkpoint_tensor_without_parameter_is_an_error(qwen3_dir, tmp_path):
    """A misread config (here: a Qwen3 checkpoint declared as Llama, which has no q/k norm) must not drop weights."""
    cfg = json.loads((qwen3_dir / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in qwen3_dir.glob("*.safetensors*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(
        CheckpointError, match=r"tensor 'model.layers.\d.self_attn.[qk]_norm.weight' matches no parameter"
    ):
        LLM(str(tmp_path), device="cpu")


def _copy_checkpoint(src, dst, config_edit=None):
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config_edit(cfg) if config_edit else cfg))
    for f in src.glob("*.safetensors*"):
        (dst / f.name).write_bytes(f.read_bytes())


@pytest.mark.parametrize(
    "key, value, method",
    [
        ("quantization_config", {"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8' without a [n, k]"),
        ("quantization_config", {"quant_method": "gptq", "bits": 8}, "'gptq' (8-bit)"),
        ("compression_config", {"format": "pack-quantized"}, "'pack-quantized'"),
    ],
)
def test_unsupported_quantized_config_is_refused_by_name(qwen3_dir, tmp_path, key, value, method):
    """A config.json declaring a quantization mrv2 does not read is refused before any weight is read, naming
    its format and the supported ones (tests/models/test_quantized_refusals.py has the full list)."""
    _copy_checkpoint(qwen3_dir, tmp_path, lambda cfg: {**cfg, key: value})
    with pytest.raises(CheckpointError, match=rf"quantization format {re.escape(method)}.* mrv2 reads 'fp8'"):
        LLM(str(tmp_path), device="cpu")


def test_quantized_tensors_are_refused_by_name(qwen3_dir, tmp_path):
    """Without a quantization config: an FP8 weight is named (never cast to the model dtype without its scale),
    and so is a scale tensor (`k_scale`) that matches no parameter."""
    from safetensors.torch import load_file, save_file

    _copy_checkpoint(qwen3_dir, tmp_path)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.0.mlp.down_proj.weight"
    shard = tmp_path / index["weight_map"][name]
    tensors = load_file(str(shard))
    original = dict(tensors)
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' is float8_e4m3fn: config.json declares no quantization"
    ):
        LLM(str(tmp_path), device="cpu")
    scale = "model.layers.0.self_attn.k_scale"
    save_file({**original, scale: torch.ones(())}, str(shard), metadata={"format": "pt"})
    index["weight_map"][scale] = shard.name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"tensor '{scale}' is a quantization tensor: config.json declares no"):
        LLM(str(tmp_path), device="cpu")


def test_skip_special_tokens_reaches_the_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    from framework.models.tokenizer import HFTokenizer

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hi": 2}, unk_token="<unk>"))
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = HFTokenizer(tmp_path, eos_token_id=1)
    assert hf.decode([2, 1]) == "hi"
    assert "</s>" in hf.decode([2, 1], skip_special_tokens=False)
