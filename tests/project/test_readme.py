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


def test_the_short_tour_runs_as_written():
    """The tour's first paragraph of code (embedded model: no files needed) runs, and `reply` is the chat's
    text: `llm.chat` returns one output per conversation, a list, as `generate` does."""
    text = (REPO / "README.md").read_text()
    block = text.split("## A short tour", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    first = "\n\n".join(block.strip().split("\n\n")[:2])  # the import, then the embedded model's lines
    namespace: dict = {}
    exec(compile(first.replace('LLM("tiny")', 'LLM("tiny", device="cpu")'), "README.md", "exec"), namespace)
    assert isinstance(namespace["reply"], str) and namespace["reply"]
    assert len(namespace["three"]) == 3
