"""Preset random weights are a pure function of (seed, parameter, element), the same on every device.

They used to come from a `torch.Generator` on the model's device: Mersenne Twister on the CPU, Philox on
CUDA, so `LLM("random_tiny", device="cpu")` and `device="cuda"` were two different models, and the GPU test
comparing their greedy tokens (tests/gpu/test_sampler_gpu.py) failed on the first request sensitive to more
than the echo of its last token. Here the generator is checked against an independent numpy version written
in true uint32 arithmetic (what any device computes), so no device stream can creep back in.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import framework.models.random_weights as rw
from framework.models.loader import build_model, init_random_weights
from framework.models.presets import preset_config
from framework.models.random_weights import normal_weights

CPU = torch.device("cpu")


def _mix(x: np.ndarray) -> np.ndarray:
    """lowbias32 in numpy uint32 (wrapping multiplication, logical shifts)."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _normal_numpy(numel: int, std: float, seed: int, stream: int) -> np.ndarray:
    """The module docstring's formula, from scratch."""
    with np.errstate(over="ignore"):
        seed_lo, seed_hi = np.uint32(seed & 0xFFFFFFFF), np.uint32((seed >> 32) & 0xFFFFFFFF)
        key = _mix(seed_lo + _mix(seed_hi + np.uint32(0x632BE5AB)))
        key = _mix(key ^ (np.uint32(stream) * np.uint32(0x9E3779B9)))
        index = np.arange(numel, dtype=np.uint32) * np.uint32(0x85EBCA6B)
        u1 = (_mix(_mix(key ^ np.uint32(1)) ^ index).astype(np.float64) + 0.5) * 2.0**-32
        u2 = (_mix(_mix(key ^ np.uint32(2)) ^ index).astype(np.float64) + 0.5) * 2.0**-32
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * math.pi * u2) * std).astype(np.float32)


@pytest.mark.parametrize("seed, stream", [(0, 0), (7, 3), (-5, 12), (2**40 + 9, 1)])
def test_normal_weights_match_the_uint32_reference(seed, stream):
    got = normal_weights((37, 11), 0.02, seed, stream, CPU)
    want = torch.from_numpy(_normal_numpy(37 * 11, 0.02, seed, stream)).view(37, 11)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("start", [0, 12345, 2**32 - 300])
def test_torch_path_of_other_devices_equals_the_numpy_cpu_path(start):
    """A GPU hashes with int64 torch ops (`_chunk_torch`); run here on the CPU it gives the CPU path's values."""
    keys = rw.stream_keys(11, 2)
    want = torch.from_numpy(rw._chunk_numpy(keys, start, start + 300, 0.02))
    got = rw._chunk_torch(keys, start, start + 300, 0.02, CPU)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
    assert (got == want).float().mean() > 0.99


def test_chunks_do_not_change_the_values(monkeypatch):
    whole = normal_weights((1000,), 0.02, 3, 4, CPU)
    monkeypatch.setattr(rw, "CHUNK", 96)  # several chunks, the last one partial
    assert torch.equal(normal_weights((1000,), 0.02, 3, 4, CPU), whole)


def test_normal_weights_have_the_asked_distribution():
    x = normal_weights((200, 500), 0.02, 1, 2, CPU).double()
    assert abs(x.mean().item()) < 3 * 0.02 / math.sqrt(x.numel())
    assert abs(x.std().item() / 0.02 - 1) < 0.01
    normal = torch.distributions.Normal(0.0, 0.02)
    for q in (0.01, 0.1, 0.5, 0.9, 0.99):  # quantiles where a normal puts them (within sampling error)
        assert abs((x <= normal.icdf(torch.tensor(q)).item()).double().mean().item() - q) < 0.006
    y = normal_weights((200, 500), 0.02, 1, 3, CPU).double()  # another parameter: independent values
    assert abs(torch.corrcoef(torch.stack([x.flatten(), y.flatten()]))[0, 1].item()) < 0.015


def test_preset_weights_are_the_device_independent_draws():
    """Every matrix of random_tiny is `normal_weights(shape, 0.02, seed, k)`, k its parameter index."""
    model = build_model(preset_config("random_tiny"), torch.float32, CPU)
    init_random_weights(model, seed=5)
    drawn = 0
    for stream, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith(".bias"):
            continue
        want = _normal_numpy(param.numel(), 0.02, 5, stream).reshape(tuple(param.shape))
        torch.testing.assert_close(param.detach(), torch.from_numpy(want), rtol=1e-6, atol=1e-9, msg=name)
        drawn += 1
    assert drawn > 3


def test_the_engine_draws_a_preset_at_its_initializer_range():
    """`LLM("random_tiny")` holds `normal_weights(shape, initializer_range, model.seed, k)` (0.2 for this preset,
    so that its output depends on the context; docs/testing.md); a preset without the key keeps HF's 0.02."""
    from framework import LLM

    std = preset_config("random_tiny")["initializer_range"]
    assert std == 0.2 and "initializer_range" not in preset_config("qwen3-0.6b")
    llm = LLM("random_tiny", device="cpu")
    seed = llm.engine.config.model.seed
    for stream, (name, param) in enumerate(llm.engine.loaded.model.named_parameters()):
        if name.endswith("norm.weight") or name.endswith(".bias"):
            continue
        want = _normal_numpy(param.numel(), std, seed, stream).reshape(tuple(param.shape))
        torch.testing.assert_close(param.detach(), torch.from_numpy(want), rtol=1e-6, atol=1e-9, msg=name)


def _reduced_preset(name: str) -> dict:
    """A preset cut to two layers and small widths, its options kept (the norms' kinds are what matter here)."""
    cfg = preset_config(name)
    if name == "gemma-3-4b":
        cfg.update(num_hidden_layers=2, hidden_size=64, intermediate_size=128, head_dim=16, vocab_size=512)
        cfg.update(num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    return cfg


@pytest.mark.parametrize("preset", ["gemma-3-4b", "qwen3_5-tiny", "gemma-4-default"])
def test_every_random_norm_scales_by_one(preset: str) -> None:
    """Zero-centred norms (Gemma 3's and Qwen3.5's `1 + weight`) get weight 0, the others weight 1: every norm of a
    random preset is the plain RMS normalisation. (Setting every `norm.weight` to 1 made the zero-centred ones
    double their input, layer after layer: a preset's outputs then described no model anyone serves.)"""
    cfg = _reduced_preset(preset) if preset != "gemma-4-default" else _gemma4_reduced()
    model = build_model(cfg, torch.float32, CPU)
    init_random_weights(model, seed=0)
    x = torch.randn(3, 64)
    norms = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm") and hasattr(m, "weight")]
    assert len(norms) >= 4
    for name, norm in norms:
        dim = norm.weight.shape[-1]
        xs = x[:, :dim] if dim <= 64 else torch.randn(3, dim)
        plain = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + norm.eps)
        torch.testing.assert_close(norm(xs), plain, rtol=1e-5, atol=1e-5, msg=name)


def _gemma4_reduced() -> dict:
    cfg = preset_config("gemma-4-default")
    cfg.update(num_hidden_layers=2, layer_types=cfg["layer_types"][4:6], hidden_size=64, intermediate_size=128)
    cfg.update(head_dim=16, global_head_dim=32, sliding_window=8, vocab_size=512, vocab_size_per_layer_input=512)
    cfg.update(hidden_size_per_layer_input=8, max_position_embeddings=128)
    return cfg
