"""The plugin registry: decorator, lazy strings, entry points, duplicates and broken plugins."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from framework import LLM, SamplingParams
from framework.config.registry import MODEL_STATES, Registry, RegistryError


def test_decorator_and_lazy_string():
    reg: Registry = Registry("thing", "mrv2.tests.none")

    @reg.register("a")
    class A:
        pass

    reg.register("od", "collections:OrderedDict")
    assert reg.get("a") is A
    from collections import OrderedDict

    assert reg.get("od") is OrderedDict
    assert reg.names() == ["a", "od"]


def test_duplicate_name_is_an_error():
    reg: Registry = Registry("thing", "mrv2.tests.none")
    reg.register("a", "collections:OrderedDict")
    with pytest.raises(RegistryError, match="thing 'a' is registered twice"):
        reg.register("a", "collections:deque")


def test_unknown_name_lists_registered():
    reg: Registry = Registry("thing", "mrv2.tests.none")
    reg.register("alpha", "collections:deque")
    with pytest.raises(RegistryError, match="unknown thing 'beta'; registered: alpha"):
        reg.get("beta")


def test_broken_lazy_plugin_is_named_and_others_still_work():
    reg: Registry = Registry("thing", "mrv2.tests.none")
    reg.register("broken", "no_such_module_xyz:Thing")
    reg.register("fine", "collections:deque")
    with pytest.raises(RegistryError, match=r"thing 'broken' .* failed to load: ModuleNotFoundError"):
        reg.get("broken")
    from collections import deque

    assert reg.get("fine") is deque


def _install_fake_distribution(root, name: str, entry_points: str, modules: dict[str, str]) -> None:
    """What `pip install` leaves behind: modules plus a .dist-info with entry_points.txt."""
    for mod, code in modules.items():
        (root / f"{mod}.py").write_text(textwrap.dedent(code))
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(entry_points))


PLUGIN_STATE = """
    from model_states.default import DefaultModelState

    CALLS = []

    class CountingModelState(DefaultModelState):
        name = "counting"

        def add_request(self, req_slot, request):
            CALLS.append(("add", req_slot, request.request_id))

        def postprocess(self, batch, num_sampled, num_rejected):
            CALLS.append(("post", batch.num_rows))
"""


def test_entry_point_plugin_provides_a_model_state(tmp_path, monkeypatch, caplog):
    _install_fake_distribution(
        tmp_path,
        "mrv2_counting_plugin",
        """
        [mrv2.model_states]
        counting = mrv2_counting_state:CountingModelState
        broken = mrv2_missing_module:Nope
        """,
        {"mrv2_counting_state": PLUGIN_STATE},
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        MODEL_STATES.load_entry_points(force=True)
        assert "counting" in MODEL_STATES.names()
        llm = LLM("random_tiny", device="cpu", model_state="counting")
        assert type(llm.engine.runner.model_state).__name__ == "CountingModelState"
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
        assert len(out[0].token_ids) == 3
        calls = sys.modules["mrv2_counting_state"].CALLS
        assert calls[0][0] == "add" and calls[0][2] == "gen-0"
        assert sum(1 for c in calls if c[0] == "post") == 3  # one postprocess per step
        # The broken plugin is reported by name and does not stop the working one.
        with pytest.raises(RegistryError, match="model state 'broken'"):
            MODEL_STATES.get("broken")
    finally:
        MODEL_STATES.unregister("counting")
        MODEL_STATES.unregister("broken")


def test_unknown_model_state_is_a_clear_error():
    with pytest.raises(RegistryError, match="unknown model state 'nope'; registered: .*default"):
        LLM("random_tiny", device="cpu", model_state="nope")


def test_duplicate_entry_point_is_reported_not_fatal(tmp_path, monkeypatch, caplog):
    _install_fake_distribution(tmp_path, "mrv2_dup_plugin", "[mrv2.model_states]\ndefault = collections:deque\n", {})
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.WARNING):
        MODEL_STATES.load_entry_points(force=True)
    assert "mrv2 plugin model state 'default' ignored" in caplog.text
    assert MODEL_STATES.get("default").__name__ == "DefaultModelState"


@pytest.mark.parametrize("first", ["model_states", "samplers", "speculators", "framework"])
def test_each_package_imports_first_in_a_fresh_interpreter(first):
    """A plugin package imports `model_states` (say) before anything else: no circular import."""
    import subprocess

    code = f"import {first}; from framework import LLM; from model_states import ModelState; print('ok')"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
