"""Tensor parallelism of the Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) in two CPU processes (gloo).

Each rank holds half the linear-attention key and value heads (with their q/k/v/z/b/a rows, conv channels,
`A_log` and `dt_bias`), half the attention and KV heads, half of every MLP's and expert's intermediate dimension and
half the vocabulary; its per-slot recurrent state holds its heads only. Qwen3.5 stores `in_proj_qkv` as q, k, v
sections (each split), Qwen3-Next groups `in_proj_qkvz` per key head (split as one block); Qwen3-Next also has
MoE layers and an MLP-only layer. Against the one-process engine on the same checkpoint, with chunked prefill and
preemption: greedy tokens equal, prompt logprobs within float32 summation order.

The layer-level test runs each rank's Gated DeltaNet in this process (no process group: the row-parallel
`out_proj`'s partial products are summed by hand) against the whole layer, and fails with the q/k/v sections
read as one block (the planted wrong head grouping).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.gdn_models import QWEN3_5, QWEN3_NEXT, slow_decay_checkpoint
from helpers.hf_models import TinySpec, random_prompts
from test_parallel import ENGINE, _shutdown

from framework.entrypoints.llm import LLM
from framework.params.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]  # spawns processes

PROMPTS = random_prompts(4, 5, 30, seed=4848)
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)


def _run(path: Path, **sizes: int) -> tuple[list[list[int]], list[torch.Tensor], int, LLM]:
    """(greedy tokens, each prompt's logprobs of its own tokens, preemptions, the engine)."""
    llm = LLM(str(path), **ENGINE, **sizes)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    logprobs = [torch.tensor([o.prompt_logprobs[i][t].logprob for i, t in enumerate(p) if i]) for o, p in
                zip(outs, PROMPTS)]  # fmt: skip
    return [o.token_ids for o in outs], logprobs, sum(o.num_preemptions for o in outs), llm


@pytest.mark.parametrize("spec", [QWEN3_5, QWEN3_NEXT], ids=lambda s: s.name)
def test_gdn_tensor_parallel_2_matches_one_process(spec: TinySpec, tmp_path: Path) -> None:
    slow_decay_checkpoint(spec, tmp_path)
    want, want_logprobs, preemptions, _ = _run(tmp_path)
    assert preemptions > 0, "the KV cache was meant to be too small: nothing was preempted"
    assert min(len(set(t)) for t in want) >= 4, "degenerate continuations"
    got, logprobs, _, llm = _run(tmp_path, tensor_parallel_size=2)
    try:
        gdn = llm.engine.runner.model.model.layers[0].linear_attn  # the driver's (rank 0's) part
        assert (gdn.geo.num_k_heads, gdn.geo.num_v_heads) == (1, 2), "the driver should hold half the GDN heads"
        assert tuple(gdn.conv1d.weight.shape) == (32, 1, 4) and tuple(gdn.A_log.shape) == (2,)
        conv, recurrent = llm.engine.runner.model_state.slabs  # [layers, slots + 1, ...]: this rank's heads
        assert conv.shape[2:] == (32, 3) and recurrent.shape[2:] == (2, 8, 8)
        assert got == want
        for ours, ref in zip(logprobs, want_logprobs):
            torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    finally:
        _shutdown(llm)


# ---- one layer, each rank in this process --------------------------------------------------------------------
def _gdn_outputs(path: Path, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole first Gated DeltaNet layer's output, the sum of its `tp` ranks' partial outputs) on two sequences
    from zero state: each rank runs its heads with its own state tables, and its `out_proj` without the
    all-reduce (a one-rank context: the partial product of its input columns)."""
    from helpers.quant_tp import load_model

    from framework.layers.parallel.context import ParallelContext
    from framework.models.gdn_layer import GDNLayerState
    from framework.models.recurrent import RecurrentStepInputs

    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(11, 64, generator=gen)
    step = RecurrentStepInputs([], torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 4, 11]).int(), False)
    outs = []
    for ctx in [ParallelContext(), *(ParallelContext(tp_size=tp, rank=r) for r in range(tp))]:
        gdn = load_model(path, ctx).model.layers[0].linear_attn
        gdn.out_proj.ctx = ParallelContext()
        geo = gdn.geo
        state = GDNLayerState(
            torch.zeros(2, geo.conv_dim, geo.conv_kernel - 1),
            torch.zeros(2, geo.num_v_heads, geo.head_k_dim, geo.head_v_dim),
            None,
            None,
        )
        with torch.no_grad():
            outs.append(gdn(hidden, state, step))
    return outs[0], sum(outs[1:])  # type: ignore[return-value]


@pytest.mark.parametrize("spec", [QWEN3_5, QWEN3_NEXT], ids=lambda s: s.name)
def test_ranks_gdn_heads_add_up_to_the_whole_layer(spec: TinySpec, tmp_path: Path) -> None:
    slow_decay_checkpoint(spec, tmp_path)
    whole, ranks = _gdn_outputs(tmp_path, 2)
    torch.testing.assert_close(ranks, whole, atol=1e-5, rtol=1e-5)


def test_planted_wrong_head_grouping_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3.5's `in_proj_qkv` (and its conv) cut as one block: rank 0 gets both q heads and no v head."""
    from framework.layers.parallel import linear
    from framework.models import loader

    def one_block(model: torch.nn.Module, name: str):  # type: ignore[no-untyped-def]
        spec = linear.shard_spec(model, name)
        return None if spec is None else spec._replace(sections=())

    monkeypatch.setattr(loader, "shard_spec", one_block)
    slow_decay_checkpoint(QWEN3_5, tmp_path)
    whole, ranks = _gdn_outputs(tmp_path, 2)
    assert not torch.allclose(ranks, whole, atol=1e-3, rtol=1e-3)


# ---- layouts and refusals -------------------------------------------------------------------------------------
def test_random_weights_of_a_rank_are_its_heads_of_the_whole() -> None:
    """The `qwen3_5-tiny` preset at tp=2: each rank's `in_proj_qkv` rows and conv channels are its block of each
    of the q, k, v sections of the one-process weights; `A_log` and `out_proj` are plain halves."""
    from framework.layers.parallel.context import ParallelContext
    from framework.models.loader import build_model, init_random_weights
    from framework.models.presets import preset_config

    hf = preset_config("qwen3_5-tiny")
    cpu = torch.device("cpu")
    whole = build_model(hf, torch.float32, cpu)
    init_random_weights(whole, seed=3)
    full = whole.model.layers[0].linear_attn
    key = hf["linear_num_key_heads"] * hf["linear_key_head_dim"]
    for rank in range(2):
        part = build_model(hf, torch.float32, cpu, ParallelContext(tp_size=2, rank=rank))
        init_random_weights(part, seed=3)
        gdn = part.model.layers[0].linear_attn
        for name in ("in_proj_qkv.weight", "conv1d.weight"):
            sections = full.get_parameter(name).split([key, key, full.geo.value_dim])
            expected = torch.cat([s.chunk(2)[rank] for s in sections])
            assert torch.equal(gdn.get_parameter(name), expected), name
        assert torch.equal(gdn.A_log, full.A_log.chunk(2)[rank])
        assert torch.equal(gdn.out_proj.weight, full.out_proj.weight.chunk(2, dim=1)[rank])


def test_layouts_the_gdn_model_cannot_split_are_refused() -> None:
    from framework.config.schema import ConfigError, load_config
    from framework.executor.launch import check_parallel_config
    from framework.layers.parallel.context import ParallelContext
    from framework.models.hf_config import UnsupportedModelError
    from framework.models.loader import build_model
    from framework.models.presets import preset_config

    hf = preset_config("qwen3_5-tiny")
    cfg = load_config({"device": "cpu", "parallel": {"tensor_parallel_size": 4}})
    with pytest.raises(ConfigError, match=r"2 linear-attention key heads \(linear_num_key_heads\) do not divide"):
        check_parallel_config(cfg, hf)
    with pytest.raises(UnsupportedModelError, match="do not run under pipeline parallelism yet"):
        build_model(hf, torch.float32, torch.device("cpu"), ParallelContext(pp_size=2, rank=1))


def test_sections_scale_to_shorter_tensors_or_are_refused() -> None:
    """A rank's block of each q, k, v section of a tensor shorter than the features (an FP8 block-scale grid: one
    row per 128 rows; packed words: one per 8), and a grid whose blocks a section boundary would cut is refused."""
    from framework.layers.parallel.linear import ShardSpec, read_shard

    weight_rows = (256, 256, 512)  # q, k, v rows of the layer
    grid = torch.arange(8 * 3).view(8, 3)  # [1024 / 128, K / 128]
    rank1 = read_shard(grid, ShardSpec(0, 1, 2, weight_rows))
    assert torch.equal(rank1, grid[[1, 3, 6, 7]])
    packed = torch.arange(5 * 128).view(5, 128)  # [K / 8, N / 8]: the sections along dim 1
    expected = torch.cat([packed[:, 0:16], packed[:, 32:48], packed[:, 64:96]], dim=1)
    assert torch.equal(read_shard(packed, ShardSpec(1, 0, 2, weight_rows)), expected)
    with pytest.raises(ValueError, match=r"cannot be cut into the sections \(128, 128, 256\)"):
        read_shard(torch.zeros(4, 2), ShardSpec(0, 0, 2, (128, 128, 256)))  # one scale row per section: no halves
