"""Runner selection: each reason V2 cannot serve a config, with runner=auto (V1, one warning) and runner=v2
(a configuration error naming the reason); runner=v1 always runs V1."""

from __future__ import annotations

import logging

import pytest

from framework import LLM, ConfigError, SamplingParams, load_config
from framework.config.registry import MODEL_STATES
from framework.engine import runner_selection as compat
from framework.layers.kernels import triton_support
from model_states.default import DefaultModelState


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "framework.engine.runner_selection" and r.levelno >= logging.WARNING
    ]


def test_cpu_config_has_no_reasons_and_auto_picks_v2(caplog) -> None:
    caplog.set_level(logging.INFO)
    assert compat.v2_unsupported_reasons(load_config({"device": "cpu"})) == []
    llm = LLM("random_tiny", device="cpu")
    assert llm.engine.runner.name == "v2" and _warnings(caplog) == []
    assert LLM("random_tiny", device="cpu", runner="v1").engine.runner.name == "v1"


# ---- V2 needs Triton on CUDA devices -------------------------------------------------------------------
@pytest.fixture
def cuda_without_triton(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(triton_support, "_cuda_available", lambda: True)
    monkeypatch.setattr(triton_support, "_triton_import_error", lambda: "ModuleNotFoundError: No module named 'triton'")
    return "the V2 runner needs Triton on CUDA devices, but 'import triton' fails (ModuleNotFoundError"


@pytest.fixture
def gpu_too_old_for_triton(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(triton_support, "_cuda_available", lambda: True)
    monkeypatch.setattr(triton_support, "_triton_import_error", lambda: None)
    monkeypatch.setattr(triton_support, "_cuda_device_capability", lambda: ("Tesla P100-PCIE-16GB", (6, 0)))
    return "Triton does not support Tesla P100-PCIE-16GB (compute capability 6.0, Triton needs 7.0 or newer)"


@pytest.mark.parametrize("environment", ["cuda_without_triton", "gpu_too_old_for_triton"])
@pytest.mark.parametrize("device", ["auto", "cuda"])
def test_triton_reasons_auto_falls_back_and_v2_fails(request, caplog, environment: str, device: str) -> None:
    reason = request.getfixturevalue(environment)
    caplog.set_level(logging.INFO)
    assert compat.select_runner(load_config({"device": device})) == "v1"
    assert len(_warnings(caplog)) == 1 and reason in _warnings(caplog)[0]
    with pytest.raises(ConfigError, match="runner=v2 cannot serve this config") as err:
        compat.select_runner(load_config({"device": device, "runner": {"kind": "v2"}}))
    assert reason in str(err.value)
    assert compat.select_runner(load_config({"device": device, "runner": {"kind": "v1"}})) == "v1"
    assert len(_warnings(caplog)) == 1  # neither v2 nor v1 warns
    # On the CPU, V2 runs its PyTorch references: Triton is not needed there.
    assert compat.v2_unsupported_reasons(load_config({"device": "cpu"})) == []


def test_working_triton_on_a_recent_gpu_is_no_reason(monkeypatch) -> None:
    monkeypatch.setattr(triton_support, "_cuda_available", lambda: True)
    monkeypatch.setattr(triton_support, "_triton_import_error", lambda: None)
    monkeypatch.setattr(triton_support, "_cuda_device_capability", lambda: ("NVIDIA H200", (9, 0)))
    assert compat.v2_unsupported_reasons(load_config({"device": "auto"})) == []


# ---- a ModelState that declares supports_v2 = False ----------------------------------------------------
class HostReadingModelState(DefaultModelState):
    """Reads each step's sampled counts on the host in `postprocess`: fine in V1's synchronous step."""

    name = "v1_only_host_reader"
    supports_v2 = False

    def __init__(self, model, hf_config, max_num_reqs, device):  # type: ignore[no-untyped-def]
        super().__init__(model, hf_config, max_num_reqs, device)
        self.sampled_per_step: list[int] = []

    def postprocess(self, batch, num_sampled, num_rejected):  # type: ignore[no-untyped-def]
        self.sampled_per_step.append(sum(num_sampled.tolist()))


@pytest.fixture
def v1_only_state():
    MODEL_STATES.register(HostReadingModelState.name, HostReadingModelState)
    yield HostReadingModelState.name
    MODEL_STATES.unregister(HostReadingModelState.name)


REASON = f"model state 'v1_only_host_reader' ({__name__}.HostReadingModelState) declares supports_v2 = False"


def test_v1_only_model_state_auto_falls_back_to_v1_and_warns_once(v1_only_state, caplog) -> None:
    caplog.set_level(logging.INFO)
    llm = LLM("random_tiny", device="cpu", model_state=v1_only_state)
    assert llm.engine.runner.name == "v1"
    outs = llm.generate(
        [[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert sum(llm.engine.runner.model_state.sampled_per_step) == 10
    assert len(_warnings(caplog)) == 1 and REASON in _warnings(caplog)[0]
    started = [r.getMessage() for r in caplog.records if r.name == "framework.engine.core"]
    assert any("runner v1" in m for m in started)  # the chosen runner is logged at start-up


def test_v1_only_model_state_with_forced_v2_fails_validation(v1_only_state) -> None:
    with pytest.raises(ConfigError, match="runner=v2 cannot serve this config") as err:
        LLM("random_tiny", device="cpu", model_state=v1_only_state, runner="v2")
    assert REASON in str(err.value)


def test_v1_only_model_state_chosen_by_the_model_class(v1_only_state, monkeypatch) -> None:
    """Without model.model_state, the model class's `model_state_name` picks the state (as at load time)."""
    from framework.models.llama import LlamaForCausalLM

    monkeypatch.setattr(LlamaForCausalLM, "model_state_name", v1_only_state, raising=False)
    assert compat.v2_unsupported_reasons(load_config({"device": "cpu"})) == [REASON]
