"""CI's own checks: no silent skips (tests/conftest.py under MRV2_CI=1), the docs build failing rather than
skipping, and the GPU batch's `gpu_tests_all` and `gpu_tests_more` jobs covering every tests/gpu file within
their time budgets."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import test_docs
from helpers.skip_policy import skip_is_allowed

pytest_plugins = ["pytester"]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "nodeid, reason, cuda, allowed",
    [
        ("tests/gpu/test_spec_gpu.py::test_x", "needs a CUDA device", False, True),
        ("tests/gpu/test_parallel_gpu.py", "needs 2 GPUs", False, True),
        ("tests/gpu/test_spec_gpu.py::test_x", "needs a CUDA device", True, False),  # a GPU machine runs them all
        ("tests/gpu/test_x_gpu.py", "could not import 'flashinfer': No module named 'flashinfer'", False, False),
        ("tests/test_docs.py::test_mkdocs_build_strict", "mkdocs is not installed", False, False),
        ("tests/test_attention_triton.py", "kernels were already compiled for the GPU", False, False),
    ],
)
def test_only_gpu_tests_may_skip_and_only_without_cuda(nodeid, reason, cuda, allowed):
    assert skip_is_allowed(nodeid, reason, cuda) is allowed


def test_a_skip_for_an_optional_dependency_fails_the_ci_run(pytester, monkeypatch):
    """End to end, with this repository's conftest: under MRV2_CI=1 the GPU-only skip passes and an
    `importorskip` of a missing package fails the session, naming it; without MRV2_CI both just skip."""
    pytester.makeconftest((REPO / "tests" / "conftest.py").read_text())
    pytester.mkdir("helpers")
    (pytester.path / "helpers/__init__.py").write_text("")
    (pytester.path / "helpers/skip_policy.py").write_text((REPO / "tests/helpers/skip_policy.py").read_text())
    pytester.mkdir("tests")
    pytester.mkdir("tests/gpu")
    (pytester.path / "tests/gpu/test_probe_gpu.py").write_text(
        "import pytest\npytestmark = pytest.mark.skipif(True, reason='needs a CUDA device')\n"
        "def test_on_gpu():\n    pass\n"
    )
    (pytester.path / "tests/test_probe.py").write_text("def test_runs():\n    pass\n")
    optional = pytester.path / "tests/test_optional.py"
    optional.write_text("import pytest\npytest.importorskip('mrv2_no_such_package')\ndef test_x():\n    pass\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the probe's "GPU-only" skip must count as one
    monkeypatch.setenv("MRV2_CI", "1")
    strict = pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests")
    assert strict.ret == 1
    strict.stdout.fnmatch_lines(
        [
            "*MRV2_CI: 2 skipped, 1 of them GPU-only*1 not allowed*",
            "*skip not allowed: tests/test_optional.py*mrv2_no_such_package*",
        ]
    )
    optional.unlink()
    assert pytester.runpytest_subprocess("-p", "no:cacheprovider", "tests").ret == 0  # GPU-only skips pass
    optional.write_text("import pytest\npytest.importorskip('mrv2_no_such_package')\n")
    monkeypatch.delenv("MRV2_CI")
    relaxed = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-ra", "tests")
    assert relaxed.ret == 0  # outside CI: a skip
    # The GPU suite's skips are one summary line, not one line each; other skips are still listed.
    relaxed.stdout.fnmatch_lines(["*1 GPU tests skipped: no CUDA device here*", "*1 passed, 2 skipped*"])
    summary = relaxed.stdout.str().split("short test summary info")[1]
    assert "test_probe_gpu" not in summary and "mrv2_no_such_package" in summary


def test_mkdocs_missing_fails_under_ci_and_skips_elsewhere(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mkdocs" else real(name, *a))
    monkeypatch.setenv("MRV2_CI", "1")
    with pytest.raises(pytest.fail.Exception, match="mkdocs is not installed"):
        test_docs.test_mkdocs_build_strict(tmp_path)
    monkeypatch.delenv("MRV2_CI")
    with pytest.raises(pytest.skip.Exception, match="mkdocs is not installed"):
        test_docs.test_mkdocs_build_strict(tmp_path)


def test_ci_run_sets_the_strict_skip_check():
    assert re.search(r"^export .*\bMRV2_CI=1\b", (REPO / ".ci" / "run").read_text(), re.MULTILINE)


def test_gpu_pieces_run_every_gpu_file_once_within_one_device_call_each():
    script = (REPO / "tests" / "gpu" / "run_pieces.sh").read_text()
    files = []
    # each run by one device call (gpu_tests_first, gpu_tests_more, gpu_tests_extra, gpu_tests_last)
    for array in ("GPU_PIECES", "GPU_PIECES_MORE", "GPU_PIECES_EXTRA", "GPU_PIECES_LAST"):
        block = re.search(rf"^{array}=\((.*?)^\)", script, re.MULTILINE | re.DOTALL)
        assert block, f"run_pieces.sh defines {array}"
        pieces = [line.strip().strip('"').split() for line in block.group(1).splitlines() if line.strip()]
        files += [f for piece in pieces for f in piece[2:]]
        assert sum(int(piece[1]) for piece in pieces) <= 580  # one device command may run 600 s
    assert sorted(files) == sorted(p.name for p in (REPO / "tests" / "gpu").glob("test_*.py"))
    assert re.search(r"^\s*gpu_tests_first\) test_groups gpu_tests_first GPU_PIECES ;;", script, re.MULTILINE)
    assert re.search(r"^\s*gpu_tests_more\) test_groups gpu_tests_more GPU_PIECES_MORE ;;", script, re.MULTILINE)
    assert re.search(r"^\s*gpu_tests_extra\) test_groups gpu_tests_extra GPU_PIECES_EXTRA ;;", script, re.MULTILINE)
    assert re.search(r"^\s*gpu_tests_last\) test_groups gpu_tests_last GPU_PIECES_LAST ;;", script, re.MULTILINE)
    assert re.search(r"^\s*gpu_tests_all\)\n.*pytest .* tests/gpu$", script, re.MULTILINE | re.DOTALL)
    assert re.search(r"^\s*nano\) .*bench experiment=nano bench.output_dir=\"\$out/nano\"", script, re.MULTILINE)


def test_the_test_command_takes_one_worker_on_a_gpu_machine(monkeypatch, pytestconfig):
    """The README's `-n logical`: pytest-xdist asks `pytest_xdist_auto_num_workers` (firstresult); tests/conftest.py
    answers 1 where CUDA is (engines take 90 % of the GPU's memory: parallel GPU files would run out) and leaves
    the count to pytest-xdist elsewhere."""
    import torch

    ask = pytestconfig.hook.pytest_xdist_auto_num_workers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ask(config=pytestconfig) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("PYTEST_XDIST_AUTO_NUM_WORKERS", "7")  # pytest-xdist's own answer, made visible
    assert ask(config=pytestconfig) == 7


def test_the_suite_runs_without_pytest_xdist():
    """The GPU machine runs tests/gpu with plain pytest (no pytest-xdist there): tests/conftest.py's xdist hook must
    be optional, or pytest stops at start-up on an unknown hook."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "tests/project/test_readme.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
