"""The third-party example under examples/mrv2-example-plugin: pip-installed (offline: --no-deps,
--no-build-isolation, into a temporary target directory), discovered through its entry points, selected and
used by the engine; the guide "Write your own ModelState" includes exactly its files and its code runs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "mrv2-example-plugin"
GUIDE = REPO / "docs" / "guides" / "write-a-model-state.md"
PYTHON_BLOCK = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin installed into a fresh target directory (built from a copy: the build writes egg-info)."""
    root = tmp_path_factory.mktemp("plugin")
    source, target = root / "src", root / "site"
    shutil.copytree(PLUGIN, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "--quiet",
            "--target",
            str(target),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    assert proc.returncode == 0, f"pip install of the example plugin failed:\n{proc.stdout}\n{proc.stderr}"
    assert list(target.glob("mrv2_example_plugin-*.dist-info/entry_points.txt"))
    return target


def _run_with_plugin(target: Path, code: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), str(REPO), env.get("PYTHONPATH")) if p)
    script = cwd / "script.py"
    script.write_text(code)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_not_registered_without_installing() -> None:
    from framework.config.registry import MODEL_STATES

    assert "steering" not in MODEL_STATES.names()


def test_guide_includes_exactly_the_package_files() -> None:
    text = GUIDE.read_text()
    included = set(SNIPPET.findall(text))
    package_files = {
        str(p.relative_to(REPO))
        for p in PLUGIN.rglob("*")
        if p.suffix in (".py", ".toml") and p.name != "__init__.py" and "__pycache__" not in p.parts
    }
    assert included == package_files
    # mkdocs renders the includes (pymdownx.snippets, base path = repository root)
    mkdocs = (REPO / "mkdocs.yml").read_text()
    assert "pymdownx.snippets" in mkdocs and "guides/write-a-model-state.md" in mkdocs


def test_plugin_discovered_selected_and_used(installed: Path, tmp_path: Path) -> None:
    """The guide's own code (its python blocks that are not file includes) runs against the installed plugin,
    then the test checks where each registration came from."""
    blocks = [b for b in PYTHON_BLOCK.findall(GUIDE.read_text()) if "--8<--" not in b]
    assert blocks, "the guide has no runnable python block"
    checks = """
from framework.config.registry import MODEL_STATES, MODELS
assert MODEL_STATES._sources["steering"] == "entry point of 'mrv2-example-plugin'", MODEL_STATES._sources
assert MODELS._sources["SteeredQwen3ForCausalLM"] == "entry point of 'mrv2-example-plugin'"
assert type(llm.engine.runner.model).__name__ == "SteeredQwen3ForCausalLM"
import mrv2_example_plugin
assert mrv2_example_plugin.__file__.startswith(%r), mrv2_example_plugin.__file__
# a bad steering request ends with an error naming the field; the engine carries on
bad = SamplingParams(max_tokens=2, extra_args={"steering": {"token_id": -3}})
failed = llm.generate([prompt], bad, use_tqdm=False)[0]
fine = llm.generate([prompt], plain, use_tqdm=False)[0]
assert failed.finish_reason == "error" and "token_id" in failed.error, failed
assert fine.token_ids == before.token_ids
print("PLUGIN-OK")
""" % str(installed)
    proc = _run_with_plugin(installed, "\n\n".join(blocks) + checks, tmp_path)
    assert proc.returncode == 0 and "PLUGIN-OK" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"


def test_steering_state_decodes_under_graphs_as_eagerly(installed: Path, tmp_path: Path) -> None:
    """The installed plugin's state opts in to decode graphs: with graphs captured (on the CPU, by a capturer
    that replays by running the captured step on the static buffers) a batch of steered and plain requests,
    padded to the next graph size, gives exactly the eager tokens."""
    code = """
import sys, tempfile
sys.path.insert(0, %r)
from helpers.fake_graphs import EagerReplayCapturer
from framework import LLM, SamplingParams
from mrv2_example_plugin.demo import write_demo_checkpoint

path = write_demo_checkpoint(tempfile.mkdtemp())
prompts = [[72, 101, 108, 108, 111], [72, 101, 108, 108, 111], [50, 60, 70, 80]]
plain = SamplingParams(temperature=0.0, max_tokens=8)
steered = SamplingParams(temperature=0.0, max_tokens=8, extra_args={"steering": {"token_id": 65, "scale": 4.0}})
outs, capturer = [], EagerReplayCapturer()
for graphs in (False, True):
    llm = LLM(path, device="cpu", max_num_seqs=4)
    if graphs:
        assert llm.engine.runner.model_state.cuda_graph_unsupported_reason() is None
        llm.engine.runner.capture_cuda_graphs(capturer)
    outs.append([o.token_ids for o in llm.generate(prompts, [plain, steered, plain], use_tqdm=False)])
assert outs[0] == outs[1], outs
assert outs[0][0] != outs[0][1]  # steering changed the continuation
assert capturer.num_replays > 0
print("GRAPHS-OK")
""" % str(REPO / "tests")
    proc = _run_with_plugin(installed, code, tmp_path)
    assert proc.returncode == 0 and "GRAPHS-OK" in proc.stdout, f"{proc.stdout}\n{proc.stderr}"
