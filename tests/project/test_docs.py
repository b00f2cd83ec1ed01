"""The documentation site builds without warnings, and the Python code in its guides runs."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
# Pages whose ```python blocks run, in order, as one script each.
RUNNABLE_PAGES = [
    "getting-started.md",
    "guides/register-a-plugin.md",
    "guides/write-a-kv-connector.md",
    "sampling.md",
    "embeddings.md",
    "whisper.md",
    "prefix-caching.md",
    "structured-outputs.md",
]
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.slow


def _quiet_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Banners some mkdocs plugins print on every build; they are not build warnings.
    env["NO_MKDOCS_2_WARNING"] = "1"
    env["DISABLE_MKDOCS_2_WARNING"] = "true"
    return env


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None:
        message = "mkdocs is not installed: pip install -e '.[docs]' to build the docs"
        if os.environ.get("MRV2_CI"):  # CI installs the docs extra: a missing mkdocs is a broken set-up
            pytest.fail(message)
        pytest.skip(message)
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=REPO,
        env=_quiet_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    for page in (
        "index",
        "getting-started/index",
        "architecture/index",
        "runners/index",
        "configuration/index",
        "guides/register-a-plugin/index",
        "sampling/index",
    ):
        assert (site / f"{page}.html").is_file(), page

    # One API page per module of the four packages, rendered by mkdocstrings.
    for package in ("framework", "model_states", "samplers", "speculators"):
        assert (site / "reference" / package / "index.html").is_file(), package
    for layer in ("params", "config", "layers", "models", "batch", "runner", "executor", "engine", "entrypoints"):
        assert (site / "reference" / "framework" / layer / "index.html").is_file(), layer  # every layer folder
    assert (site / "benchmark-history" / "index.html").is_file()
    runner_page = (site / "reference/framework/runner/model_runner/index.html").read_text()
    assert 'id="framework.runner.model_runner.ModelRunnerV2"' in runner_page
    assert 'id="framework.runner.model_runner.ModelRunnerV2.execute_model"' in runner_page
    # Shape comments next to fields reach the reference (docs/griffe_comments.py).
    batch_page = (site / "reference/framework/batch/input_batch/index.html").read_text()
    assert "[R] int32: batch_row -&gt; req_slot" in batch_page
    assert ":class:" not in (site / "reference/framework/config/schema/index.html").read_text()  # Sphinx roles rendered

    # The configuration reference is generated from the pydantic schema: every key of every group is there,
    # down to the keys of nested sections (speculator.dynamic.explore_every).
    from framework.config.schema import Mrv2Config

    def leaves(model: type, prefix: str = "") -> list[str]:
        return [
            key
            for name, field in model.model_fields.items()
            for key in (
                leaves(field.annotation, f"{prefix}{name}.")
                if hasattr(field.annotation, "model_fields")
                else [f"{prefix}{name}"]
            )
        ]

    config_page = (site / "reference/config/index.html").read_text()
    keys = leaves(Mrv2Config)
    assert "speculator.dynamic.explore_every" in keys
    for key in keys:
        assert f"<code>{key}</code>" in config_page, key


@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_guide_code_runs(page: str, tmp_path: Path) -> None:
    blocks = PYTHON_BLOCK.findall((DOCS / page).read_text())
    assert blocks, f"{page} has no ```python blocks"
    script = tmp_path / "guide.py"
    script.write_text("\n\n".join(blocks))
    # A fresh interpreter, so plugins registered by the guide do not leak into other tests' registries.
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=_quiet_env(), capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"code of docs/{page} failed:\n{proc.stdout}\n{proc.stderr}"


def test_the_home_page_fits_its_code_boxes_and_leads_to_serving():
    """A new user's first page: its commands fit a code box without scrolling, and Serving is one click away
    (second after Getting started, in the nav and in "Where to go next")."""
    import yaml

    home = (REPO / "docs" / "index.md").read_text()
    code = [ln for block in home.split("```")[1::2] for ln in block.splitlines()[1:]]
    assert code and max(len(ln) for ln in code) <= 90, max(code, key=len)
    rows = [ln for ln in home.split("## Where to go next", 1)[1].splitlines() if ln.startswith("| [")]
    assert "(serving.md)" in rows[1], rows[:2]

    class _Loader(yaml.SafeLoader):
        pass

    _Loader.add_multi_constructor("", lambda loader, suffix, node: None)  # mkdocs' !!python tags
    nav = yaml.load((REPO / "mkdocs.yml").read_text(), Loader=_Loader)["nav"]
    assert [next(iter(entry.values())) for entry in nav[:3]] == ["index.md", "getting-started.md", "serving.md"]
