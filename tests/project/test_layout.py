"""The tree's shape: `framework/` is made of layer folders (few loose modules), and files stay short.

A file over `MAX_LINES` has usually started to own two things (docs: STYLE, "Short files"); files that define
Triton kernels (`@triton.jit`) are exempt, as a kernel, its wrapper and its reference belong together.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_LINES = 400
MAX_LOOSE_MODULES = 8
# Files allowed over MAX_LINES while a branch shortens them; drop an entry once its file is short (the test says).
LONG_FILES_FOR_NOW: tuple[str, ...] = ()
_SKIPPED_DIRS = {"build", "dist", "site", "__pycache__", "node_modules"}


def python_files(root: Path) -> list[Path]:
    """The .py files under `root`, outside hidden, build and cache folders."""
    return sorted(
        path
        for path in root.rglob("*.py")
        if not any(
            part.startswith(".") or part in _SKIPPED_DIRS or part.endswith(".egg-info")
            for part in path.relative_to(root).parts[:-1]
        )
    )


def too_long(root: Path, allowed: tuple[str, ...] = LONG_FILES_FOR_NOW) -> tuple[list[str], list[str]]:
    """(files over MAX_LINES that define no Triton kernel and are not allowed, allowlist patterns matching no
    long file: the allowlist entries that can go)."""
    long_files = []
    for path in python_files(root):
        text = path.read_text(errors="replace")
        if text.count("\n") + (not text.endswith("\n") and bool(text)) > MAX_LINES and "@triton.jit" not in text:
            long_files.append(path.relative_to(root).as_posix())
    bad = [f for f in long_files if not any(fnmatch.fnmatch(f, pattern) for pattern in allowed)]
    stale = [pattern for pattern in allowed if not any(fnmatch.fnmatch(f, pattern) for f in long_files)]
    return bad, stale


def loose_modules(root: Path) -> list[str]:
    """The modules directly in `framework/` (not in a layer folder), `__init__.py` aside."""
    return sorted(p.name for p in (root / "framework").glob("*.py") if p.name != "__init__.py")


def test_framework_is_made_of_layer_folders():
    loose = loose_modules(REPO)
    assert len(loose) <= MAX_LOOSE_MODULES, f"{len(loose)} loose modules in framework/ (a folder waiting?): {loose}"


def test_no_long_files_but_triton_kernels():
    bad, stale = too_long(REPO)
    assert not bad, f"over {MAX_LINES} lines: {bad} (split by topic)"
    assert not stale, f"no longer long, drop from LONG_FILES_FOR_NOW: {stale}"


def test_the_layout_checks_find_planted_violations(tmp_path):
    """Negative control: a long plain file is reported, a long kernel file, an allowed file and files in hidden
    folders are not; a tenth loose module is counted."""
    long_text = "x = 1\n" * (MAX_LINES + 1)
    for name, text in {
        "framework/__init__.py": long_text,
        "framework/engine/core.py": long_text,
        "framework/layers/kernels/k.py": "@triton.jit\n" + long_text,
        ".venv/lib/big.py": long_text,
        "framework/short.py": "x = 1\n" * MAX_LINES,
    }.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert too_long(tmp_path, ("framework/engine/core.py", "scripts/*")) == (["framework/__init__.py"], ["scripts/*"])
    assert loose_modules(tmp_path) == ["short.py"]
    for i in range(MAX_LOOSE_MODULES):
        (tmp_path / f"framework/m{i}.py").write_text("")
    assert len(loose_modules(tmp_path)) == MAX_LOOSE_MODULES + 1


def test_test_file_names_are_unique():
    """Test folders have no `__init__.py`: pytest imports each file under its basename, so two files of one name
    in different folders would clash (and `from test_x import ...` between files relies on it)."""
    names = [p.name for p in (REPO / "tests").rglob("test_*.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    packages = [p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("__init__.py")]
    assert packages == ["tests/helpers/__init__.py"], "only tests/helpers is a package"
