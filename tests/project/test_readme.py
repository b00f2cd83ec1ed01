"""The README's two commands stay true: `.ci/run` runs exactly its test command."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    lines = (REPO / "README.md").read_text().splitlines()
    return [ln for ln in lines if ln.startswith("python3 -m pip install")]


def test_readme_starts_with_run_and_test_commands():
    run, test = _commands()[:2]
    assert run.endswith("&& mrv2 run")
    assert test.endswith("&& python3 -m pytest -q -n logical --dist loadfile")
    assert test in (REPO / ".ci" / "run").read_text()
