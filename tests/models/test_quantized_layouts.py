"""The test checkpoints' compressed-tensors layouts, read by the `compressed-tensors` library itself (not by mrv2):
its config model accepts the written `quantization_config`, and its unpacker turns `weight_packed` back into the
signed 4-bit values whose product with `weight_scale` is the weight the HF reference runs (the one mrv2's parity
tests match). So the writer's packing is the library's, not only mrv2's reading of it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.quant_checkpoints import INT4_GROUP, write_quantized
from safetensors.torch import load_file

pytest.importorskip("compressed_tensors")


@pytest.mark.parametrize("fmt", ["ct-channel", "ct-tensor", "ct-w4a16"])
def test_the_library_accepts_the_config(fmt: str, tmp_path: Path) -> None:
    from compressed_tensors.quantization import QuantizationConfig

    write_quantized(fmt, tmp_path)
    config = QuantizationConfig.model_validate(
        json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    )
    weights = config.config_groups["group_0"].weights
    assert weights is not None and weights.num_bits == (4 if fmt == "ct-w4a16" else 8)


def test_the_library_unpacks_the_w4a16_weights(tmp_path: Path) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    hf_model = write_quantized("ct-w4a16", tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    layer = "model.layers.1.mlp.down_proj"
    shape = torch.Size(tensors[f"{layer}.weight_shape"].tolist())
    signed = unpack_from_int32(tensors[f"{layer}.weight_packed"], 4, shape)
    assert signed.min() >= -8 and signed.max() <= 7
    scale = tensors[f"{layer}.weight_scale"].float().repeat_interleave(INT4_GROUP, dim=1)
    torch.testing.assert_close(signed.float() * scale, hf_model.get_parameter(f"{layer}.weight"), rtol=0, atol=0)
