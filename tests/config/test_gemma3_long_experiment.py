"""`experiment=gemma3_long` (issue 55's KV-memory run): composes with `cache.kv_groups` either way, holds its four
32K requests at once on an 80 GB GPU without groups, and its chunk size leaves KV groups room to show the target
(at least 4x fewer KV bytes per token) by docs/sliding-window.md#kv-memory's rule, even at a step where one request
computes its last prompt chunk."""

from __future__ import annotations

import pytest

from framework.config.schema import Mrv2Config, load_config
from framework.entrypoints.cli import conf_dir
from framework.models.gemma3_config import Gemma3Config
from framework.models.presets import preset_config
from framework.params.kv_groups import kv_group_layout

H100_BYTES = 80e9


def _config(kv_groups: bool) -> Mrv2Config:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="bench", overrides=["experiment=gemma3_long", f"cache.kv_groups={kv_groups}"])
    return load_config(cfg)


@pytest.mark.parametrize("kv_groups", [True, False])
def test_the_experiment_composes_and_holds_every_request(kv_groups: bool) -> None:
    config = _config(kv_groups)
    bench = config.bench
    assert config.cache.kv_groups is kv_groups and config.model.preset == "gemma-3-4b"
    assert bench.input_len[1] + bench.output_len[1] <= config.model.max_model_len
    assert bench.num_requests <= config.scheduler.max_num_seqs  # all resident at the peak
    assert bench.input_len[0] >= 30_000 and config.scheduler.max_num_batched_tokens < bench.input_len[0]


def test_the_geometry_fits_an_h100_and_groups_can_reach_4x() -> None:
    config = _config(False)
    hf = preset_config("gemma-3-4b")
    model = Gemma3Config.from_hf(hf)
    windows = [model.layer_window(layer) for layer in range(model.num_layers)]
    layout = kv_group_layout(windows)
    assert layout is not None and layout.num_tensors == 5 and layout.num_groups == 7
    layer_block = 2 * config.cache.block_size * hf["num_key_value_heads"] * hf["head_dim"] * 2  # K and V, bf16
    # Without groups: every request at max_model_len, every layer, beside the bf16 weights.
    per_layer = hf["hidden_size"] * (2 * hf["num_attention_heads"] + 2 * hf["num_key_value_heads"]) * hf["head_dim"]
    params = hf["vocab_size"] * hf["hidden_size"] + model.num_layers * (
        per_layer + 3 * hf["hidden_size"] * hf["intermediate_size"]
    )
    blocks = -(-config.model.max_model_len // config.cache.block_size)
    full_kv = config.bench.num_requests * blocks * model.num_layers * layer_block
    assert 2 * params + full_kv < config.cache.gpu_memory_utilization * H100_BYTES - 10e9  # 10 GB for activations
    # The docs' rule at the worst peak step: every request at its full length, one computing its last chunk.
    bs, chunk, n = config.cache.block_size, config.scheduler.max_num_batched_tokens, config.bench.num_requests
    position_blocks = -(-(config.bench.input_len[1] + config.bench.output_len[1]) // bs)
    window_groups = [w for w in layout.group_windows if w]
    decode = sum(-(-(w - 1 + 1) // bs) + 1 for w in window_groups)
    prefill = sum(-(-(w - 1 + chunk) // bs) + 1 for w in window_groups)
    grouped = (n * position_blocks + (n - 1) * decode + prefill) * layout.num_tensors
    assert grouped / (n * position_blocks * model.num_layers) < 0.25
