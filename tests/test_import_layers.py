"""Imports between mrv2's modules form a DAG (issue 28), and the public imports work in any order.

The graph comes from an AST walk over framework/, model_states/, samplers/ and speculators/ (`import_graph`):
only module-level imports count, not imports inside functions (they run after every module has loaded) nor
those under `if TYPE_CHECKING:` (they never run).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from import_graph import (
    SHARED_PLAIN_TYPES,
    find_cycle,
    forbidden_imports,
    import_graph,
    layer_violations,
    reached_upward,
)

REPO = Path(__file__).resolve().parents[1]

PLUGINS = ("model_states", "speculators")
PLUGIN_DOOR = ("framework.runner.plugins",)  # the one framework module that imports the plugin packages
# The model layers and what they stand on, and what stands on them: the runners, the engine, the parallel
# driver and workers, the API, CLI and server.
LOWER = (
    "framework.models",
    "framework.layers.attention",
    "framework.layers.kernels",
    "framework.layers.parallel.context",
)
UPPER = (
    "framework.executor",
    "framework.runner.model_runner",
    "framework.runner.v1",
    "framework.engine.core",
    "framework.runner.plugins",
    "framework.entrypoints.llm",
    "framework.entrypoints.cli",
    "framework.entrypoints.serve",
)


def test_no_import_cycle_between_the_projects_modules():
    graph = import_graph(REPO)
    assert len(graph) > 100 and graph["framework.engine.core"], "the walk found too few modules or no imports"
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycles_issue_28_named_stay_broken():
    """Each pair the issue named (the first through `samplers/__init__`) has no edge back, not even through a
    function-level or TYPE_CHECKING import (which is how they had been hidden)."""
    graph = import_graph(REPO, deferred=True)
    assert "framework" not in graph["samplers"]
    assert "samplers" not in graph["framework.runner.v1.model_runner"]
    assert "framework.executor.worker" not in graph["framework.executor.launch"]
    assert "speculators.head_drafter" not in graph["speculators.draft_graphs"]
    assert "speculators.dynamic" not in graph["speculators.policy"]


def test_samplers_import_nothing_above_the_kernels_and_the_shared_plain_types():
    """Issue 28: the samplers import only `framework.layers.kernels` and the plain types they share with the runner
    (`import_graph.SHARED_PLAIN_TYPES`), function-level and TYPE_CHECKING imports included; those types
    import nothing above themselves either."""
    graph = import_graph(REPO, deferred=True)
    assert all(name in graph for name in SHARED_PLAIN_TYPES), "a shared plain type was moved: update the list"
    assert any(b == "framework.params.sampling_params" for a in graph if a.startswith("samplers.") for b in graph[a])
    violations = layer_violations(graph, "samplers")
    assert not violations, "layer violations: " + ", ".join(f"{a} -> {b}" for a, b in violations)


def test_the_layer_check_finds_planted_violations(tmp_path):
    """Negative control: a sampler module importing the engine (even inside a function), and a shared plain
    type importing the config, are both reported; the kernels and the plain types are not."""
    root = _tree(
        tmp_path,
        {
            "framework/__init__.py": "",
            "framework/engine/core.py": "",
            "framework/config/schema.py": "",
            "framework/layers/kernels/__init__.py": "",
            "framework/layers/kernels/scatter.py": "",
            "framework/batch/staged_writes.py": "from framework.layers.kernels.scatter import scatter\n",
            "framework/params/sampling_params.py": "import framework.config.schema\n",
            "samplers/__init__.py": "from samplers import k\n",
            "samplers/k.py": "from framework.batch.staged_writes import StagedWrites\nfrom framework.params.sampling_params import S\n",
            "samplers/late.py": "def f():\n    from framework.engine.core import EngineCore\n",
        },
    )
    graph = import_graph(root, ("framework", "samplers"), deferred=True)
    assert layer_violations(graph, "samplers") == [
        ("samplers.late", "framework.engine.core"),
        ("framework.params.sampling_params", "framework.config.schema"),
    ]
    (root / "framework/params/sampling_params.py").write_text("")
    (root / "samplers/late.py").write_text("")
    assert layer_violations(import_graph(root, ("framework", "samplers"), deferred=True), "samplers") == []


def test_framework_reaches_the_plugin_packages_only_through_its_door():
    """The runners and the engine build model states and speculators through `framework.runner.plugins` (registry
    lookups); no other framework module imports `model_states` or `speculators`, not even in a function or for
    type checking."""
    graph = import_graph(REPO, deferred=True)
    assert forbidden_imports(graph, ("framework",), PLUGINS, allowed=PLUGIN_DOOR) == []
    assert {"model_states.selection", "speculators.interface"} <= graph["framework.runner.plugins"]  # the door is used
    assert (
        "framework.runner.plugins" in graph["framework.runner.model_runner"]
        and "framework.runner.plugins" in graph["framework.engine.core"]
    )


def test_model_layers_never_reach_the_runner_or_the_parallel_driver():
    """Models, attention, kernels and the parallel context sit below the runner: nothing they import, directly
    or through other modules, in a function or not, is the runner, the engine or `framework.executor`."""
    graph = import_graph(REPO, deferred=True)
    assert reached_upward(graph, LOWER, UPPER) == []
    assert "framework.layers.parallel.context" in graph["framework.layers.parallel.linear"]
    assert "framework.runner.model_runner" in graph["framework.executor.driver"]  # the upper side is where it was


def test_the_layer_checks_find_planted_violations(tmp_path):
    """Negative control: a framework module importing a plugin package in a function or under TYPE_CHECKING, and
    a model layer reaching the parallel worker through a helper's function-level import, are both reported; the
    door's own imports are not."""
    root = _tree(
        tmp_path,
        {
            "framework/__init__.py": "",
            "framework/runner/plugins.py": "from speculators.x import Spec\nimport model_states\n",
            "framework/runner.py": "def build():\n    from speculators.x import Spec\n",
            "framework/types.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from model_states import S\n",
            "framework/models/__init__.py": "",
            "framework/models/layer.py": "from framework import helpers\n",
            "framework/helpers.py": "def rank():\n    from framework.executor.worker import serve\n",
            "framework/executor/__init__.py": "",
            "framework/executor/worker.py": "import framework.runner\n",
            "model_states/__init__.py": "",
            "speculators/__init__.py": "",
            "speculators/x.py": "import framework.helpers\n",
        },
    )
    packages = ("framework", "model_states", "speculators")
    graph = import_graph(root, packages, deferred=True)
    assert forbidden_imports(graph, ("framework",), PLUGINS, allowed=PLUGIN_DOOR) == [
        ("framework.runner", "speculators.x"),
        ("framework.types", "model_states"),
    ]
    assert reached_upward(graph, ("framework.models",), ("framework.executor",)) == [
        ("framework.models.layer", "framework.executor.worker")
    ]
    (root / "framework/helpers.py").write_text("def rank():\n    return 0\n")
    (root / "framework/runner.py").write_text("from framework import plugins\n")
    (root / "framework/types.py").write_text("")
    graph = import_graph(root, packages, deferred=True)
    assert forbidden_imports(graph, ("framework",), PLUGINS, allowed=PLUGIN_DOOR) == []
    assert reached_upward(graph, ("framework.models",), ("framework.executor",)) == []


ENGINE = (
    "framework.engine.core",
    "framework.runner.model_runner",
    "framework.runner.v1",
    "framework.runner.plugins",
    "framework.models",
    "framework.executor.driver",
    "framework.executor.worker",
)


def _engine_modules_loaded_by(packages: list[str]) -> dict[str, list[str]]:
    """Package -> the modules of ENGINE loaded once it (and the packages before it) are imported, in one fresh
    interpreter."""
    probe = (
        "import importlib, json, sys\nloaded = {}\n"
        f"for p in {packages!r}:\n"
        "    importlib.import_module(p)\n"
        f"    loaded[p] = sorted(m for m in sys.modules if any(m == e or m.startswith(e + '.') for e in {ENGINE!r}))\n"
        "print(json.dumps(loaded))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_package_inits_load_none_of_the_engine():
    """`import <package>` re-exports its public API without loading the runners, the engine or the models (they
    load when first used). Control: importing the engine afterwards loads them, so the probe would see them."""
    packages = ["framework", "model_states", "speculators", "samplers", "framework.executor", "framework.engine.core"]
    loaded = _engine_modules_loaded_by(packages)
    assert {p: loaded[p] for p in packages[:-1]} == {p: [] for p in packages[:-1]}
    assert {"framework.engine.core", "framework.runner.plugins", "framework.runner.model_runner"} <= set(
        loaded["framework.engine.core"]
    )


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_walk_finds_a_planted_cycle_and_ignores_function_and_type_checking_imports(tmp_path):
    """Negative control: a cycle through a relative and a `from pkg import submodule` import is found; the same
    imports inside a function or under TYPE_CHECKING are not edges."""
    root = _tree(
        tmp_path,
        {
            "framework/__init__.py": "",
            "framework/a.py": "from . import b\n",
            "framework/b.py": "try:\n    from framework.c import thing\nexcept ImportError:\n    pass\n",
            "framework/c.py": "class C:\n    from framework.a import x\n",
            "samplers/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import framework.a\n",
            "samplers/k.py": "def f():\n    import samplers.k2\n",
            "samplers/k2.py": "import samplers.k\n",
        },
    )
    graph = import_graph(root, ("framework", "samplers"))
    assert graph["framework.a"] == {"framework.b"} and graph["samplers"] == set() and graph["samplers.k"] == set()
    assert find_cycle(graph) == ["framework.a", "framework.b", "framework.c", "framework.a"]
    (root / "framework/c.py").write_text("def late():\n    from framework.a import x\n")
    assert find_cycle(import_graph(root, ("framework", "samplers"))) == []
    deferred = import_graph(root, ("framework", "samplers"), deferred=True)
    assert deferred["samplers"] == {"framework.a"} and deferred["samplers.k"] == {"samplers.k2"}


@pytest.mark.parametrize("first", ["samplers", "speculators", "model_states"])
def test_a_plugin_package_imports_before_framework(first):
    """The order the removed "import order matters" comment guarded: a plugin package first, then the public API."""
    code = (
        f"import {first}\nfrom framework import LLM, SamplingParams, EngineCore\nimport framework.engine.core\n"
        "import samplers, speculators.dynamic, framework.executor.driver, framework.entrypoints.serve\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
