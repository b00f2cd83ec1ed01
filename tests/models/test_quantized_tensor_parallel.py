"""Tensor parallelism of quantized layers, rank by rank in one process: every rank's model loads its part of the
checkpoint, and each layer's ranks' products must add up to the whole layer's (row-parallel: summed partial
products; column-parallel: concatenated outputs; MoE experts: summed over the intermediate dimension).

- INT4 linear layers (GPTQ, GPTQ act-order asymmetric, AWQ, compressed-tensors W4A16) on the tiny Qwen3 whose
  down_proj has 160 inputs per rank (each rank starts or ends mid-group of 64);
- quantized experts: FP8 block, per-tensor, GPTQ (the two-process test runs the other formats); online FP8
  experts quantize each rank's part;
- the padded act-order layout through the W4A16 kernel (interpreter);
- the rank layout on random groups (mid-group splits, act-order with padding) keeps every weight;
- controls: a rank given the other rank's g_idx slice (row layer), or the other rank's scales (column layer), is
  caught;
- what cannot be split is refused by name with the numbers: packed words cut in two, an FP8 block or an INT4 group
  of the experts cut by the rank boundary.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.quant_checkpoints import QUANT_SPEC, write_quantized
from helpers.quant_tp import MOE_TP_SPEC, expert_products, linear_products, load_model, whole_and_ranks
from safetensors.torch import load_file, save_file

from framework.layers.parallel.context import ParallelContext
from framework.layers.quantization.int4_parallel import gather_input, rank_group_layout, scatter_columns
from framework.models.loader import CheckpointError, build_model, read_hf_config

LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def _check_layers(path: Path, layers: tuple[str, ...] = LAYERS) -> None:
    whole, ranks = whole_and_ranks(path)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    for name in layers:
        want, got = linear_products(whole, ranks, f"model.layers.1.{name}", x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fmt", ["gptq", "gptq-act-asym", "awq", "ct-w4a16"])
def test_int4_ranks_add_up_to_the_whole_layer(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path, QUANT_SPEC)
    _check_layers(tmp_path)


@pytest.mark.parametrize("fmt", ["fp8-block", "ct-tensor", "gptq"])  # the others: test_parallel_quant_moe.py
def test_quantized_experts_ranks_add_up_to_the_whole(fmt: str, tmp_path: Path) -> None:
    write_quantized(fmt, tmp_path, MOE_TP_SPEC)
    whole, ranks = whole_and_ranks(tmp_path)
    assert ranks[0].model.layers[0].mlp.experts.expert_dims == (4, 128, 256)
    want, got = expert_products(whole, ranks, layer=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_online_fp8_experts_quantize_each_ranks_part(tmp_path: Path) -> None:
    """`model.quantization=fp8` under tp=2: gate/up rows are quantized exactly as in one process (whole rows);
    down's scales are per output channel of the rank's columns (amax of its part / 448)."""
    from helpers.hf_models import build_hf_model
    from helpers.quant_checkpoints import write_plain

    write_plain(build_hf_model(MOE_TP_SPEC), tmp_path)
    whole = load_model(tmp_path, quantization="fp8").model.layers[1].mlp.experts
    plain = load_model(tmp_path).model.layers[1].mlp.experts
    part = load_model(tmp_path, ParallelContext(tp_size=2, rank=1), quantization="fp8").model.layers[1].mlp.experts
    rows = slice(128, 256)  # rank 1's half of the intermediate dimension
    assert torch.equal(part.gate_up_proj.view(torch.uint8), whole.gate_up_proj[:, :, rows].view(torch.uint8))
    assert torch.equal(part.gate_up_proj_weight_scale, whole.gate_up_proj_weight_scale[:, :, rows])
    scale = plain.down_proj[:, :, rows].abs().amax(dim=-1, keepdim=True) / 448
    torch.testing.assert_close(part.down_proj_weight_scale, scale)


def test_act_order_rank_layout_through_the_kernel(tmp_path: Path) -> None:
    """A row-parallel act-order rank's layout (runs padded to units of 16+ with zero-activation columns) is what the
    W4A16 kernel reads: Triton (interpreter) against the reference, on rank 1's down_proj."""
    write_quantized("gptq-act-asym", tmp_path, QUANT_SPEC)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(1))
    for rank in range(2):
        layer = load_model(tmp_path, ParallelContext(tp_size=2, rank=rank)).get_submodule(
            "model.layers.1.mlp.down_proj"
        )
        assert layer.int4_group % 16 == 0 and layer.perm.numel() > layer.in_features  # padded runs
        want = layer.quant_method.apply(layer, x, None)
        layer.kernel_backend = "triton"
        torch.testing.assert_close(layer.quant_method.apply(layer, x, None), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k, group, act_order", [(160, 64, False), (96, 64, False), (256, 128, True), (176, 32, True)])
def test_rank_group_layout_keeps_every_weight(k: int, group: int, act_order: bool) -> None:
    """The rank layout (sorted, padded, one scale per unit) dequantizes to each column's own group scale and zero."""
    g = torch.Generator().manual_seed(k)
    whole = 2 * k
    order = torch.randperm(whole, generator=g) if act_order else torch.arange(whole)
    col_group = (torch.argsort(order) // group)[k:]  # rank 1's columns of a layer of 2k inputs
    q = torch.randint(0, 16, (24, k), generator=g, dtype=torch.uint8)
    scales, zeros = (
        torch.rand(24, whole // group, generator=g) + 0.1,
        torch.randint(0, 16, (24, whole // group)).float(),
    )
    q2, s2, z2, perm, unit = rank_group_layout(q, col_group, scales, zeros, group)
    assert unit % 16 == 0 and q2.shape[1] % unit == 0 and s2.shape == z2.shape == (24, q2.shape[1] // unit)
    dense = s2.repeat_interleave(unit, 1) * (q2.float() - z2.repeat_interleave(unit, 1))
    got = dense if perm is None else scatter_columns(dense, perm, k)
    torch.testing.assert_close(got, scales[:, col_group] * (q.float() - zeros[:, col_group]))
    x = torch.randn(3, k, generator=g)
    xs = x if perm is None else gather_input(x, perm)
    torch.testing.assert_close(xs @ dense.t(), x @ got.t(), rtol=1e-4, atol=1e-4)


def _swap_halves(path: Path, name: str, dim: int) -> None:
    """Rewrite `name` with its two halves along `dim` exchanged: each rank reads the other rank's slice."""
    tensors = load_file(str(path / "model.safetensors"))
    a, b = tensors[name].chunk(2, dim=dim)
    tensors[name] = torch.cat([b, a], dim=dim).contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "fmt, tensor, dim",
    [("gptq-act-asym", "mlp.down_proj.g_idx", 0), ("awq", "self_attn.q_proj.scales", 1)],
    ids=["row-g_idx", "column-scales"],
)
def test_a_rank_reading_the_other_ranks_slice_is_caught(fmt: str, tensor: str, dim: int, tmp_path: Path) -> None:
    """Control: the ranks of a checkpoint whose g_idx (or scales) halves are exchanged no longer add up to the
    whole layer of the intact checkpoint, so the test above would catch a wrong slice."""
    write_quantized(fmt, tmp_path / "intact", QUANT_SPEC)
    whole = load_model(tmp_path / "intact")
    shutil.copytree(tmp_path / "intact", tmp_path / "swapped")
    _swap_halves(tmp_path / "swapped", f"model.layers.1.{tensor}", dim)
    ranks = [load_model(tmp_path / "swapped", ParallelContext(tp_size=2, rank=r)) for r in range(2)]
    layer = f"model.layers.1.{tensor.rsplit('.', 1)[0]}"
    want, got = linear_products(whole, ranks, layer, torch.randn(3, 512, generator=torch.Generator().manual_seed(0)))
    assert (got - want).abs().max() > 1e-2


def _refused(path: Path, **config: object) -> str:
    """The error building rank 0 of a tp=2 model from `path`'s config.json with `config` overriding its keys."""
    hf = {**read_hf_config(path), **config}
    with pytest.raises(CheckpointError) as err:
        build_model(hf, torch.float32, torch.device("cpu"), ParallelContext(tp_size=2, rank=0))
    return str(err.value)


def test_what_cannot_be_split_is_refused_by_name(tmp_path: Path) -> None:
    write_quantized("awq", tmp_path / "awq", QUANT_SPEC)
    quant = {**read_hf_config(tmp_path / "awq")["quantization_config"], "group_size": 8}
    # 328 gate/up rows: 164 per rank cut AWQ's words of eight output columns.
    message = _refused(tmp_path / "awq", intermediate_size=328, quantization_config=quant)
    assert "mlp.gate_proj: int4-awq needs both dimensions a multiple of 8 (N=164, K=192 per rank over 2" in message
    write_quantized("fp8-block", tmp_path / "fp8", MOE_TP_SPEC)
    message = _refused(tmp_path / "fp8", moe_intermediate_size=128)
    assert "mlp.experts: 64 intermediate features per rank (moe_intermediate_size 128 over 2 tensor-parallel" in message
    assert "not a multiple of the fp8-block-moe block 128" in message
    write_quantized("gptq", tmp_path / "gptq", MOE_TP_SPEC)
    message = _refused(tmp_path / "gptq", moe_intermediate_size=192)
    assert "96 intermediate features per rank (moe_intermediate_size 192 over 2" in message
    assert "not a multiple of the int4-gptq-moe group size 64" in message
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    assert config["moe_intermediate_size"] == 256  # the checkpoint itself splits (tested above)
