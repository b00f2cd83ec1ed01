"""Pass/fail summary of a tests/gpu run made in pieces (`tests/gpu/run_pieces.sh OUT gpu_tests_first`).

Reads the JUnit XML report of every piece (`--junitxml`), prints one line per piece (passed / failed / errors /
skipped, seconds) and the totals, names every failed or skipped test with its message, and lists the GPU test
files that no piece ran (a new file must be added to a piece, not silently left out). Exit status 1 when anything
failed, errored, skipped or was left out. The lead copies the totals, commit and date into docs/benchmarks.md.

    python3 tests/gpu/summary.py RESULTS_DIR     # RESULTS_DIR/<piece>.xml, one per piece
    python3 tests/gpu/summary.py RESULTS_DIR --expect test_a_gpu.py ...   # only these files are due
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]


def _git(*args: str, env: dict[str, str] | None = None) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env).stdout.strip()


def _commit() -> str:
    """HEAD, and the hash of the working tree as git would store it (tracked and untracked-not-ignored files).

    A copy of the checkout made for a GPU machine may carry a stale `.git` whose HEAD is not the tree that ran;
    the tree hash names the tree itself: `git log --format='%h %t' | grep TREE` finds its commit here."""
    try:
        head = _git("rev-parse", "--short", "HEAD") or "unknown (no git checkout here)"
        with tempfile.TemporaryDirectory() as tmp:  # a throwaway index: the checkout's own is left alone
            env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
            _git("add", "-A", env=env)
            tree = _git("write-tree", env=env)[:7]
        return f"{head} (working tree {tree or 'unknown'})"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git here)"


def summarise(results: Path, expected_files: Optional[list[str]] = None) -> tuple[list[str], bool]:
    """(report lines, all passed) for the piece reports in `results`; `expected_files` (names of tests/gpu files)
    are those the pieces must have run, default every tests/gpu file (`run_pieces.sh` passes its list's)."""
    lines, totals, problems, files_run = [], {"passed": 0, "failed": 0, "error": 0, "skipped": 0}, [], set()
    reports = sorted(results.glob("*.xml"))
    for report in reports:
        counts, seconds = {k: 0 for k in totals}, 0.0
        for case in ET.parse(report).getroot().iter("testcase"):
            seconds += float(case.get("time", 0))
            # A module-level skip is one case named after the module, with no classname.
            files_run.add((case.get("classname") or case.get("name") or "").split(".")[-1])
            kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
            kind = "failed" if kind == "failure" else kind
            counts[kind] += 1
            if kind != "passed":
                message = next(c for c in case if c.tag in ("failure", "error", "skipped")).get("message", "")
                problems.append(f"  {kind}: {case.get('classname')}::{case.get('name')}: {message[:200]}")
        for k in totals:
            totals[k] += counts[k]
        lines.append(f"{report.stem:28s} " + " ".join(f"{k} {v:3d}" for k, v in counts.items()) + f"  {seconds:6.1f} s")
    expected = (
        {Path(f).stem for f in expected_files}
        if expected_files
        else {p.stem for p in (REPO / "tests" / "gpu").glob("test_*.py")}
    )
    missing = sorted(expected - files_run)
    ok = bool(reports) and totals["failed"] == totals["error"] == totals["skipped"] == 0 and not missing
    lines.append("total                        " + " ".join(f"{k} {v:3d}" for k, v in totals.items()))
    lines.extend(problems)
    if missing:
        lines.append(f"  not run by any piece (or collected nothing): {', '.join(missing)}")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines.append(f"tests/gpu: {'PASS' if ok else 'FAIL'} at commit {_commit()}, {date}")
    return lines, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="directory holding one JUnit XML report per piece")
    parser.add_argument(
        "--expect", nargs="*", default=None, help="the tests/gpu files these pieces must have run (default: every one)"
    )
    args = parser.parse_args()
    lines, ok = summarise(args.results, args.expect)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
