"""What mrv2 refuses of quantized checkpoints, and how: each refusal names the format or the tensor.

- formats mrv2 does not read (NVFP4, GGUF, bitsandbytes, GPTQ / AWQ, compressed-tensors' packed INT4, an
  unknown method) are refused from config.json alone, before any weight is read (the weight file here is not even
  a safetensors file), with the list of supported formats;
- malformed checkpoints are refused by tensor name: a scale of the wrong shape, a missing scale, a weight in the
  wrong dtype, a scale on a layer the config keeps in 16 bits, a non-positive scale;
- nothing of a refused load stays alive (no FP8 tensor outlives the failed `LLM`).
Also: tensor parallelism splits FP8 weights and their scales so that the ranks' products add up to the whole
layer's (column layers: concatenated; row layers: summed), for block and per-channel scales.
"""

from __future__ import annotations

import gc
import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers.quant_checkpoints import TP_SPEC, edit_checkpoint, write_quantized

from framework.entrypoints.llm import LLM
from framework.layers.parallel.context import ParallelContext
from framework.models.loader import CheckpointError, build_model, load_safetensors_weights, read_hf_config

CPU = torch.device("cpu")
CT_GROUP: dict = {
    "targets": ["Linear"],
    "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
}


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fp8")
    write_quantized("fp8-block", path)
    return path


def _copy(src: Path, dst: Path, quant: dict | None = None, corrupt_weights: bool = False) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    if quant is not None:
        config["quantization_config"] = quant
    (dst / "config.json").write_text(json.dumps(config))
    weights = b"not a safetensors file" if corrupt_weights else (src / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(weights)
    return dst


@pytest.mark.parametrize(
    "quant, named",
    [
        (
            {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": CT_GROUP}},
            "'compressed-tensors' (format nvfp4-pack-quantized)",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {**CT_GROUP, "weights": {**CT_GROUP["weights"], "symmetric": False}}},
            },
            "'compressed-tensors' group 'g' (asymmetric or group act-order 4-bit weights)",
        ),
        (
            {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"g": CT_GROUP}},
            "'compressed-tensors' (format int-quantized)",
        ),
        ({"quant_method": "gguf"}, "'gguf'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "'gptq' (8-bit)"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "gptq_v2"}, "'gptq' (4-bit) (checkpoint_format"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "'awq' (4-bit) (version gemv)"),
        ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt' (quant_algo NVFP4)"),
        ({"quant_method": "some-new-method"}, "'some-new-method'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8' without a [n, k] weight_block_size"),
        ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "'fp8' with weight_block_size [128, 100]"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "kv_cache_scheme": {"num_bits": 8, "type": "float"},
                "config_groups": {},
            },
            "'compressed-tensors' with a kv_cache_scheme",
        ),
    ],
)
def test_unsupported_formats_are_refused_before_reading_weights(fp8_dir, tmp_path, quant, named) -> None:  # type: ignore[no-untyped-def]
    path = _copy(fp8_dir, tmp_path / "ckpt", quant, corrupt_weights=True)
    with pytest.raises(CheckpointError) as err:
        LLM(str(path), device="cpu")
    message = str(err.value)
    assert f"quantization format {named}" in message
    assert "mrv2 reads 'fp8'" in message and "'compressed-tensors' format 'float-quantized'" in message
    assert "'gptq' (4-bit, v1 checkpoints), 'awq' (4-bit, GEMM packing)" in message


def test_online_fp8_of_a_quantized_checkpoint_is_refused(fp8_dir) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(CheckpointError, match=r"model.quantization=fp8 quantizes a 16-bit checkpoint, but"):
        LLM(str(fp8_dir), device="cpu", quantization="fp8")


def test_quantized_unsupported_architecture_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    config = {
        "architectures": ["JambaForCausalLM"],
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'JambaForCausalLM' does not support quantized weights \(fp8\)"):
        build_model(config, torch.float32, CPU)


L0 = "model.layers.0."


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            {L0 + "self_attn__q_proj__weight_scale_inv": torch.ones(3, 2)},
            rf"'{L0}self_attn.q_proj.weight_scale_inv' has shape \(3, 2\), model expects \(2, 2\)",
        ),
        (
            {L0 + "mlp__down_proj__weight": torch.zeros(192, 320, dtype=torch.bfloat16)},
            rf"tensor '{L0}mlp.down_proj.weight' is bfloat16, the checkpoint's quantization format stores it as "
            "float8_e4m3fn",
        ),
        (
            {L0 + "self_attn__o_proj__weight_scale_inv": -torch.ones(2, 2)},
            rf"{L0}self_attn.o_proj.weight_scale_inv: scales must be finite and positive",
        ),
        ({L0 + "input_layernorm__weight_scale": torch.ones(1)}, "is a quantization tensor: the quantization config"),
    ],
)
def test_malformed_checkpoints_are_refused_by_tensor_name(fp8_dir, tmp_path, edit, message) -> None:  # type: ignore[no-untyped-def]
    path = _copy(fp8_dir, tmp_path / "ckpt")
    edit_checkpoint(path, **edit)
    with pytest.raises(CheckpointError, match=message):
        LLM(str(path), device="cpu")


def test_missing_scale_is_refused_by_name(fp8_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    path = _copy(fp8_dir, tmp_path / "ckpt")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[L0 + "mlp.up_proj.weight_scale_inv"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"lacks weights: {L0}mlp.up_proj.weight_scale_inv"):
        LLM(str(path), device="cpu")


def _fp8_tensors() -> int:
    warnings.simplefilter("ignore", FutureWarning)  # isinstance on torch.distributed's deprecated aliases
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.dtype == torch.float8_e4m3fn)


def test_a_refused_load_keeps_nothing(fp8_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = _copy(fp8_dir, tmp_path / "ckpt")
    edit_checkpoint(path, **{"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(5, 5)})
    gc.collect()
    before = _fp8_tensors()
    with pytest.raises(CheckpointError):
        LLM(str(path), device="cpu")
    gc.collect()
    assert _fp8_tensors() == before


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-channel"])
def test_tensor_parallel_ranks_split_weights_and_scales(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path, TP_SPEC)
    hf = read_hf_config(tmp_path)
    whole = build_model(hf, torch.float32, CPU)
    load_safetensors_weights(whole, tmp_path)
    ranks = []
    for rank in range(2):
        model = build_model(hf, torch.float32, CPU, ParallelContext(tp_size=2, rank=rank))
        load_safetensors_weights(model, tmp_path)
        ranks.append(model)
    x = torch.randn(3, 512)
    for name in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
        full = whole.get_submodule(f"model.layers.1.{name}")
        parts = [m.get_submodule(f"model.layers.1.{name}") for m in ranks]
        k = full.in_features
        if name.endswith(("o_proj", "down_proj")):  # row-parallel: each rank's partial product, summed
            per = parts[0].in_features
            got = sum(p.quant_method.apply(p, x[:, r * per : (r + 1) * per], None) for r, p in enumerate(parts))
        else:  # column-parallel: the ranks' output features, concatenated
            got = torch.cat([p.quant_method.apply(p, x[:, :k], None) for p in parts], dim=-1)
        torch.testing.assert_close(got, full.quant_method.apply(full, x[:, :k], None), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_block_split_must_follow_the_blocks(tmp_path: Path) -> None:
    """k_proj has 128 rows: 64 per rank under tp=2 would cut a 128-row scale block in half."""
    write_quantized("fp8-block", tmp_path)
    with pytest.raises(
        CheckpointError, match=r"k_proj: 64 output features per rank is not a multiple of the fp8-block"
    ):
        build_model(read_hf_config(tmp_path), torch.float32, CPU, ParallelContext(tp_size=2, rank=0))


def test_int4_group_size_must_divide_the_input_dimension(tmp_path: Path) -> None:
    write_quantized("gptq", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["group_size"] = 128  # the tiny model's hidden size is 192
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"q_proj: group size 128 does not divide the input dimension 192"):
        LLM(str(tmp_path), device="cpu")


def test_int4_packed_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path: Path) -> None:
    write_quantized("awq", tmp_path)
    edit_checkpoint(tmp_path, **{L0 + "mlp__up_proj__qzeros": torch.zeros(2, 40, dtype=torch.int32)})
    with pytest.raises(
        CheckpointError, match=rf"'{L0}mlp.up_proj.qzeros' has shape \(2, 40\), model expects \(3, 40\)"
    ):
        LLM(str(tmp_path), device="cpu")
