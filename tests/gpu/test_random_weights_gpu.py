"""Preset random weights on a GPU equal the CPU's (skipped without CUDA).

Before, they came from a `torch.Generator` on the model's device (Philox on CUDA, Mersenne Twister on the
CPU): `LLM("random_tiny", device="cuda")` was another model than on the CPU, and
`test_sampler_gpu.py::test_engine_samples_with_every_parameter_on_the_gpu` compared the two.

Run on the GPU machine: `python3 -m pytest -q tests/gpu/test_random_weights_gpu.py` (about 20 s).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_preset_weights_are_the_same_on_the_cpu_and_the_gpu():
    from framework.models.loader import build_model, init_random_weights
    from framework.models.presets import preset_config

    models = {}
    for device in ("cpu", "cuda"):
        models[device] = build_model(preset_config("random_tiny"), torch.float32, torch.device(device))
        init_random_weights(models[device], seed=0)
    cpu, gpu = dict(models["cpu"].named_parameters()), dict(models["cuda"].named_parameters())
    assert cpu.keys() == gpu.keys()
    for name, value in cpu.items():
        torch.testing.assert_close(gpu[name].detach().cpu(), value.detach(), rtol=1e-6, atol=1e-9, msg=name)


def test_normal_weights_at_real_size_match_across_devices(monkeypatch):
    """Several chunks of a large parameter: the int64 torch hash on the GPU equals numpy's uint32 hash."""
    import framework.models.random_weights as rw

    monkeypatch.setattr(rw, "CHUNK", 1 << 22)
    shape = (8192, 1536)  # 12.6M elements, 3 chunks
    cpu = rw.normal_weights(shape, 0.02, 1234, 17, torch.device("cpu"))
    gpu = rw.normal_weights(shape, 0.02, 1234, 17, torch.device("cuda")).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=1e-6, atol=1e-9)
    assert int((gpu != cpu).sum()) <= 100  # float64 log/cos may differ by an ulp: a rare last-bit flip at most
