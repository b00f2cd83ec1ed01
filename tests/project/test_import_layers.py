"""mrv2's folders are its layers: a module imports only modules of its own folder or of folders below it (issue
"The layers become folders"), the imports between modules form a DAG (issue 28), and the public imports work in
any order.

The graph comes from an AST walk over framework/, model_states/, samplers/ and speculators/ (`import_graph`). The
layer rule counts every import, in a function or under `if TYPE_CHECKING:` too; the cycle check counts the
module-level ones (those that run when the module is imported).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.import_graph import LAYERS, find_cycle, import_graph, layer_of, upward_imports

REPO = Path(__file__).resolve().parents[2]


def test_every_module_is_in_a_layer_folder():
    graph = import_graph(REPO, deferred=True)
    assert len(graph) > 100 and graph["framework.engine.core"], "the walk found too few modules or no imports"
    assert [m for m in graph if layer_of(m) is None] == []
    assert {layer_of(m) for m in graph} == set(LAYERS), "a layer folder of LAYERS has no module: update the list"


def test_no_module_imports_a_folder_above_its_own():
    """The one layer rule, over function-level and TYPE_CHECKING imports too."""
    violations = upward_imports(import_graph(REPO, deferred=True))
    assert not violations, "upward imports: " + ", ".join(
        f"{a} ({layer_of(a)}) -> {b} ({layer_of(b)})" for a, b in violations
    )


def test_no_import_cycle_between_the_projects_modules():
    graph = import_graph(REPO)
    cycle = find_cycle(graph)
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_cycles_issue_28_named_stay_broken():
    """The pairs inside one folder that issue 28 named have no edge back, not even through a function-level or
    TYPE_CHECKING import (which is how they had been hidden); the layer rule does not see inside a folder."""
    graph = import_graph(REPO, deferred=True)
    assert "framework.executor.worker" not in graph["framework.executor.launch"]
    assert "speculators.head_drafter" not in graph["speculators.draft_graphs"]
    assert "speculators.dynamic" not in graph["speculators.policy"]


PLANTED = {
    "framework/__init__.py": "from framework.engine import core\n",
    "framework/params/__init__.py": "",
    "framework/params/sampling.py": "",
    "framework/config/__init__.py": "",
    "framework/config/schema.py": "from framework.params.sampling import S\n",
    "framework/models/__init__.py": "",
    "framework/models/llama.py": "from framework.config import schema\nfrom . import helpers\n",
    "framework/models/helpers.py": "",
    "framework/engine/__init__.py": "",
    "framework/engine/core.py": "import samplers.k\nfrom framework.models.llama import Llama\n",
    "samplers/__init__.py": "",
    "samplers/k.py": "from framework.params.sampling import S\n",
}


def test_the_layer_rule_finds_planted_upward_imports(tmp_path):
    """Negative control: an upward import at module level, under TYPE_CHECKING and inside a function are each
    reported; imports down or within a folder (relative ones included) and the root's are not."""
    packages = ("framework", "samplers")
    root = _tree(tmp_path, PLANTED)
    assert upward_imports(import_graph(root, packages, deferred=True)) == []
    plants = {
        "framework/params/sampling.py": (
            "import framework.config.schema\n",
            "framework.params.sampling",
            "framework.config.schema",
        ),
        "samplers/k.py": (
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from framework.engine.core import E\n",
            "samplers.k",
            "framework.engine.core",
        ),
        "framework/models/helpers.py": (
            "def f():\n    from framework import LLM\n",
            "framework.models.helpers",
            "framework",
        ),
    }
    for name, (text, importer, imported) in plants.items():
        (root / name).write_text(text)
        assert upward_imports(import_graph(root, packages, deferred=True)) == [(importer, imported)], name
        (root / name).write_text(PLANTED[name])


def test_the_cycle_check_finds_a_planted_cycle(tmp_path):
    """Negative control: a cycle inside one folder (which the layer rule allows) is found."""
    root = _tree(tmp_path, {**PLANTED, "framework/models/helpers.py": "from framework.models import llama\n"})
    graph = import_graph(root, ("framework", "samplers"))
    assert upward_imports(graph) == []
    assert find_cycle(graph) == ["framework.models.llama", "framework.models.helpers", "framework.models.llama"]
    (root / "framework/models/helpers.py").write_text("def f():\n    from framework.models import llama\n")
    assert find_cycle(import_graph(root, ("framework", "samplers"))) == []


ENGINE = (
    "framework.engine.core",
    "framework.runner.model_runner",
    "framework.runner.v1",
    "framework.runner.plugins",
    # The model families, the loader and start-up; `framework.models.interface` (the `Model` ABC the plugins
    # check against) is light and may load.
    "framework.models.loader",
    "framework.models.llama",
    "framework.models.setup",
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
