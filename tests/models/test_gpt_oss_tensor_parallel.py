"""gpt-oss's tensor-parallel parts, rank by rank in one process (the two-process runs:
`tests/executor/test_parallel_gpt_oss.py`).

- Each rank's experts (bf16 and MXFP4, loaded from the checkpoint) give partial outputs that add up to the whole
  layer's, the down bias in rank 0's part only; the ranks' sinks are the whole model's, split with the heads.
- Random weights (the `gpt-oss-20b-mxfp4` preset's path): a rank's MXFP4 blocks, exponents, biases and sinks are
  its slices of the one-process model's (the whole model is rebuilt with its quantization to draw them).
- MXFP4 under a tensor-parallel size that does not divide the experts' 32-input blocks is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from helpers.mxfp4_checkpoints import build_gpt_oss, write_gpt_oss_mxfp4
from helpers.quant_tp import whole_and_ranks
from test_hf_parity_gpt_oss import SPEC

from framework.layers.parallel.context import ParallelContext
from framework.models.loader import CheckpointError, build_model, init_random_weights

# Two blocks of 32 intermediate features: one per rank at tp=2 (MXFP4); the rest is test_hf_parity_gpt_oss's.
TP_SPEC = dataclasses.replace(SPEC, config_kwargs={**SPEC.config_kwargs, "intermediate_size": 64})
CPU = torch.device("cpu")


def _expert_outputs(models: list[torch.nn.Module], layer: int) -> list[torch.Tensor]:
    """Each model's experts (no all-reduce) on the same random tokens and routing."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    weights, ids = torch.softmax(torch.randn(5, 4, generator=g), -1).topk(2, dim=-1)
    return [m.model.layers[layer].mlp.experts(x, weights, ids, "reference") for m in models]


@pytest.mark.parametrize("experts", ["bf16", "mxfp4"])
def test_ranks_add_up_to_the_whole_layer(experts: str, tmp_path: Path) -> None:
    if experts == "bf16":
        build_gpt_oss(TP_SPEC).save_pretrained(tmp_path, safe_serialization=True)
    else:
        write_gpt_oss_mxfp4(TP_SPEC, tmp_path)
    whole, ranks = whole_and_ranks(tmp_path)
    assert ranks[1].model.layers[1].mlp.experts.expert_dims == (4, 32, 64)
    with torch.no_grad():
        want, *parts = _expert_outputs([whole, *ranks], layer=1)
        torch.testing.assert_close(parts[0] + parts[1], want, rtol=1e-5, atol=1e-5)
        before = [_expert_outputs([r], layer=1)[0] for r in ranks]
        for r in ranks:
            r.model.layers[1].mlp.experts.down_proj_bias.zero_()
        after = [_expert_outputs([r], layer=1)[0] for r in ranks]
    assert not torch.allclose(after[0], before[0]), "rank 0 adds the down bias"
    assert torch.equal(after[1], before[1]), "rank 1 does not"
    for layer in range(4):
        sinks = torch.cat([r.model.layers[layer].self_attn.sinks for r in ranks])
        torch.testing.assert_close(sinks, whole.model.layers[layer].self_attn.sinks, rtol=0, atol=0)


def test_random_mxfp4_weights_of_a_rank_are_slices_of_the_whole(tmp_path: Path) -> None:
    write_gpt_oss_mxfp4(TP_SPEC, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    models = [
        build_model(config, torch.float32, CPU, ParallelContext(tp_size=t, rank=r)) for t, r in [(1, 0), (2, 0), (2, 1)]
    ]
    for model in models:
        init_random_weights(model, seed=3, std=0.02)
    whole, ranks = models[0], models[1:]
    prefix = "model.layers.2"
    for name, dim in [
        ("mlp.experts.gate_up_proj_blocks", 2),
        ("mlp.experts.gate_up_proj_scales", 2),
        ("mlp.experts.gate_up_proj_bias", 2),
        ("mlp.experts.down_proj_blocks", 2),
        ("mlp.experts.down_proj_scales", 2),
        ("self_attn.sinks", 0),
        ("self_attn.q_proj.weight", 0),
    ]:
        full = whole.get_parameter(f"{prefix}.{name}")
        torch.testing.assert_close(
            torch.cat([r.get_parameter(f"{prefix}.{name}") for r in ranks], dim), full, rtol=0, atol=0, msg=name
        )
    bias = f"{prefix}.mlp.experts.down_proj_bias"
    assert all(torch.equal(r.get_parameter(bias), whole.get_parameter(bias)) for r in ranks)
    assert len(whole.get_parameter(f"{prefix}.mlp.experts.down_proj_blocks").unique()) > 200, "random bytes drawn"


def test_mxfp4_blocks_that_tp_does_not_divide_are_refused(tmp_path: Path) -> None:
    """`test_hf_parity_gpt_oss`'s SPEC: intermediate_size 32, one block of 32 down inputs for two ranks."""
    write_gpt_oss_mxfp4(SPEC, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    build_model(config, torch.float32, CPU)  # one rank: fine
    with pytest.raises(CheckpointError) as err:
        build_model(config, torch.float32, CPU, ParallelContext(tp_size=2, rank=1))
    assert (
        "model.layers.0.mlp.experts: parallel.tensor_parallel_size=2 does not divide the mxfp4 experts' 1 blocks of "
        "32 intermediate features (intermediate_size 32)" in str(err.value)
    )
