"""`build_model` allocates each weight once, in the serving dtype: peak ~1x the weights, not the float32 model.

The peak is read from the CPU allocator's own events (`torch.profiler` with `profile_memory=True`): every
allocation and free of the build and the safetensors load, in time order. The old build (float32 on the
device, then `.to(dtype)`) is measured with the same meter as the negative control, so the meter can fail.
Equality with that old build (same shapes, dtypes, ties, buffers, and the same random-preset weights for the
same seed) shows the change is invisible to everything downstream.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.profiler import ProfilerActivity, profile

from framework.config.registry import MODELS
from framework.models.loader import build_model, init_random_weights, load_safetensors_weights
from framework.models.materialise import build_materialised
from framework.models.presets import preset_config

CPU = torch.device("cpu")


def _peak_bytes(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), the most bytes of CPU tensors live at once while it ran, counted from the allocator's events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage  # allocations positive, frees ("[memory]" events) negative
        peak = max(peak, live)
    return result, peak


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _eager_build(hf_config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    """The build before this change: float32 on the device, then cast."""
    with torch.device(CPU):
        return MODELS.get(hf_config["architectures"][0]).from_hf_config(hf_config).to(dtype=dtype)


def _small_llama() -> dict[str, Any]:
    """random_tiny's family with more layers, so no single tensor is a large part of the weights (the loader
    holds one checkpoint tensor at a time on top of the model)."""
    return {
        **preset_config("random_tiny"),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "vocab_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
    }


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    cfg = _small_llama()
    model = _eager_build(cfg, torch.bfloat16)
    init_random_weights(model, 3, 0.02)
    root = tmp_path_factory.mktemp("bf16-ckpt")
    tensors = {n: t.contiguous() for n, t in model.state_dict().items() if n != "lm_head.weight"}  # tied
    save_file(tensors, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps(cfg))
    return root


def test_build_and_load_peak_stays_near_the_bf16_weights(bf16_checkpoint: Path) -> None:
    cfg = _small_llama()

    def build_and_load() -> nn.Module:
        model = build_model(cfg, torch.bfloat16, CPU)
        load_safetensors_weights(model, bf16_checkpoint)
        return model

    built, build_peak = _peak_bytes(lambda: build_model(cfg, torch.bfloat16, CPU))
    weights = _weight_bytes(built)
    assert build_peak < 1.05 * weights, f"the build peaked at {build_peak / weights:.2f}x the bf16 weight bytes"
    model, peak = _peak_bytes(build_and_load)
    # safetensors maps each shard file into one CPU storage (file-backed pages, no copy): the allocator counts
    # it once per open shard, so the budget is the weights + one checkpoint tensor in flight + the open shard.
    shard = (bf16_checkpoint / "model.safetensors").stat().st_size
    assert peak - shard < 1.3 * weights, f"build + load peaked at {(peak - shard) / weights:.2f}x the weights + shard"
    reference = _eager_build(cfg, torch.bfloat16)
    load_safetensors_weights(reference, bf16_checkpoint)
    for (name, got), (_, want) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(got, want), name


def test_the_meter_sees_the_float32_build() -> None:
    """Negative control: the old build peaks at >= 2x the bf16 weights under the same meter."""
    cfg = _small_llama()
    model, peak = _peak_bytes(lambda: _eager_build(cfg, torch.bfloat16))
    assert peak >= 1.9 * _weight_bytes(model)


@pytest.mark.parametrize("preset", ["random_tiny", "qwen3-moe-tiny", "jamba-tiny"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_build_equals_the_eager_build(preset: str, dtype: torch.dtype) -> None:
    """Same parameter names, shapes, dtypes, ties and buffers; the preset's random weights are the same numbers."""
    cfg = preset_config(preset)
    model, reference = build_model(cfg, dtype, CPU), _eager_build(cfg, dtype)
    init_random_weights(model, 11, 0.02)
    init_random_weights(reference, 11, 0.02)
    got, want = model.state_dict(), reference.state_dict()
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].device == want[name].device, name
        assert torch.equal(got[name], want[name]), name
    assert dict(model.named_buffers()).keys() == dict(reference.named_buffers()).keys()
    for name, buf in reference.named_buffers():
        mine = dict(model.named_buffers())[name]
        if name.endswith("inv_freq"):  # RoPE frequencies stay float32 (the eager build's `.to` rounds them)
            assert mine.dtype == torch.float32 and torch.equal(mine.to(buf.dtype), buf), name
        else:
            assert torch.equal(mine, buf), name
    shared = lambda m: {n for n, p in m.named_parameters(remove_duplicate=False)} - {n for n, _ in m.named_parameters()}
    assert shared(model) == shared(reference)  # tied weights stay one parameter
    assert all(p.requires_grad == q.requires_grad for p, q in zip(model.parameters(), reference.parameters()))


class _WithBuffer(nn.Module):
    """A third-party model with a constructor-computed buffer and no `init_buffers()`."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("scale", torch.arange(4, dtype=torch.float32) / 3, persistent=False)


def test_model_with_buffers_but_no_init_buffers_is_built_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="framework.models.materialise"):
        model = build_materialised(_WithBuffer, torch.bfloat16, CPU)
    assert "no init_buffers()" in caplog.text
    assert torch.equal(model.scale, (torch.arange(4, dtype=torch.float32) / 3).to(torch.bfloat16))
    assert model.proj.weight.dtype == torch.bfloat16 and not model.proj.weight.is_meta


def test_init_buffers_that_leaves_meta_tensors_is_refused() -> None:
    class Forgetful(_WithBuffer):
        def init_buffers(self) -> None:
            pass  # forgets `scale`

    with pytest.raises(RuntimeError, match="left tensors on the meta device: scale"):
        build_materialised(Forgetful, torch.bfloat16, CPU)


@pytest.mark.parametrize("preset", ["random_tiny", "gemma-3-4b"])
def test_rope_frequencies_stay_float32_in_a_bf16_model(preset: str) -> None:
    """A bf16 model's RoPE angles at position 32,000 equal float32 arithmetic on the config's frequencies (as HF's
    `from_pretrained` keeps `inv_freq` float32); bf16 frequencies would be off by radians there."""
    cfg = preset_config(preset)
    model = build_model(cfg, torch.bfloat16, CPU)
    buffers = {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())
    want = build_model(cfg, torch.float32, CPU)
    positions = torch.tensor([32_000.0])
    for name, buf in buffers.items():
        exact = positions[:, None] * dict(want.named_buffers())[name][None, :]
        assert torch.equal(positions[:, None] * buf[None, :], exact), name
        rounded = positions[:, None] * buf.bfloat16().float()[None, :]
        assert (rounded - exact).abs().max() > 1.0  # what the test guards against
