"""Run a test module again in a fresh interpreter process and report its outcomes there.

For the kernel test modules that must run the Triton interpreter: when a GPU test module imported (and so
compiled) the kernels first in this process, each of their tests reports the outcome of its run in one fresh
process under `TRITON_INTERPRET=1` instead of skipping.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]


def outcomes_of_a_fresh_run(path: str, outcomes: dict[str, str]) -> dict[str, str]:
    """{test name with parameters: 'passed' | 'failed: ...' | 'skipped: ...'} of the module at `path` run in a
    fresh process under the interpreter (once: kept in `outcomes`)."""
    if not outcomes:
        with tempfile.TemporaryDirectory() as tmp:
            report = os.path.join(tmp, "report.xml")
            env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, f"--junitxml={report}"],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            if not os.path.exists(report):
                raise AssertionError(f"the fresh run of {path} wrote no report:\n{proc.stdout}{proc.stderr}")
            for case in ET.parse(report).getroot().iter("testcase"):
                problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
                outcomes[case.get("name", "")] = (
                    "passed" if problem is None else f"{problem.tag}: {problem.get('message', '')}"
                )
    return outcomes


def from_a_fresh_process(test, path: str, outcomes: Callable[[], dict[str, str]]):  # type: ignore[no-untyped-def]
    """The test, reporting the outcome of its run in the fresh process (same name, same parameters); `outcomes()`
    gives the cache of that run's outcomes."""

    @functools.wraps(test)
    def delegated(*args, **kwargs):  # type: ignore[no-untyped-def]
        name = os.environ["PYTEST_CURRENT_TEST"].split("::")[-1].rsplit(" ", 1)[0]
        outcome = outcomes_of_a_fresh_run(path, outcomes()).get(name, "missing from the fresh run")
        assert outcome == "passed", f"{name} in a fresh interpreter process: {outcome}"

    return delegated
