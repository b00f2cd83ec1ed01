"""Shared fixtures: the embedded random-weight tiny model on the CPU, small enough for every test to build its own."""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Test files live in folders that mirror the code's layers (tests/engine, tests/samplers, ...), without
# `__init__.py`: pytest imports each under its own basename (basenames are unique, tests/project/test_layout.py).
# `tests/` on sys.path makes the shared `helpers` package importable, and every test folder on it lets a test
# import another's cases (`from test_hf_parity import PROMPTS`) whichever file pytest or an xdist worker loaded
# first, and under the same module name pytest gives it (no second copy).
_TESTS = Path(__file__).resolve().parent
for _folder in [_TESTS, *sorted(p.parent for p in _TESTS.rglob("test_*.py") if "helpers" not in p.parts)]:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))

# Without a GPU, Triton kernels run in Triton's interpreter. The flag is read when a kernel is decorated, i.e.
# when framework modules are imported, so it must be set here, before any test module imports them.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's test command runs `-n logical`) each worker gets its share of the cores: two
# workers of two torch threads each on CI's two cores would spin against each other in every matmul.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _threads = max(1, _cores // _workers)
    torch.set_num_threads(_threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(_threads))  # the CLI, server and script processes tests start


@pytest.hookimpl(optionalhook=True)  # optional: the GPU machine runs tests/gpu without pytest-xdist installed
def pytest_xdist_auto_num_workers(config):  # type: ignore[no-untyped-def]
    """`-n logical` / `-n auto` on a machine with a CUDA GPU: one worker. Engines take 90 % of the GPU's memory
    (`cache.gpu_memory_utilization`), so GPU test files in parallel workers would run out of it. Without a GPU:
    None, i.e. pytest-xdist's own count."""
    return 1 if torch.cuda.is_available() else None


def _use_this_checkouts_conf() -> None:
    """Make `mrv2_conf` (this repo's `conf/`, installed under that name) come from this checkout.

    A checkout put in front of an installed mrv2 through PYTHONPATH shadows `framework` & co. but not
    `mrv2_conf`, whose directory is named differently, so Hydra would compose the installed copy's YAML.
    A symlink named `mrv2_conf` on sys.path and on PYTHONPATH (for the CLI subprocesses) fixes that.
    """
    spec = importlib.util.find_spec("mrv2_conf")
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == REPO / "conf":
        return
    shim = Path(tempfile.mkdtemp(prefix="mrv2-conf-"))
    atexit.register(shutil.rmtree, shim, True)
    (shim / "mrv2_conf").symlink_to(REPO / "conf", target_is_directory=True)
    sys.path.insert(0, str(shim))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p)
    sys.modules.pop("mrv2_conf", None)


_use_this_checkouts_conf()

# `conf/base.yaml` composes the schema's defaults (a ConfigStore entry) first: tests that compose with Hydra's
# compose API need it registered, as the CLI does before it composes.
from framework.config.hydra_defaults import register_schema_defaults  # noqa: E402

register_schema_defaults()
# CLI subprocesses (`python -m framework.entrypoints.cli`, `mrv2`) import this checkout too, not another installed
# copy (a
# worktree beside an editable install of the main checkout would otherwise test the main checkout's code).
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)


@pytest.fixture
def tiny_llm_factory():
    """Build `LLM("random_tiny", device="cpu", ...)` (random weights, byte tokenizer) with overrides."""
    from framework import LLM

    def make(**kwargs):
        kwargs.setdefault("device", "cpu")
        return LLM("random_tiny", **kwargs)

    return make


@pytest.fixture(scope="session")
def tiny_llm():
    from framework import LLM

    return LLM("random_tiny", device="cpu")


@pytest.fixture(scope="session")
def hf_greedy_reference():
    """`reference(prompts, max_tokens)`: HF transformers' greedy tokens of `random_tiny` (the weights of
    `LLM("random_tiny", device="cpu")`), built once per test run (see `helpers/hf_reference.py`)."""
    from helpers.hf_reference import HFGreedyReference

    return HFGreedyReference()


def python_exe() -> str:
    return sys.executable


@pytest.fixture
def leak_check():
    """`leak_check(scheduler)` / `leak_check.engine(engine)`: assert nothing is queued and every block/slot is free."""
    from helpers.leak_check import assert_engine_drained, assert_no_leaks

    assert_no_leaks.engine = assert_engine_drained  # type: ignore[attr-defined]
    return assert_no_leaks


@pytest.fixture
def one_thread():
    """Run torch on one thread: on a small shared CPU the tiny model's many tiny ops are faster that way."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def _planted_fault_for_a_mutation_run():
    """`MRV2_PLANTED_FAULT=<name>` (a key of `planted_faults.FAULTS`) plants that fault for the whole session,
    before any engine is built: a mutation run shows which tests catch it. Unset (CI), nothing is planted."""
    name = os.environ.get("MRV2_PLANTED_FAULT")
    if not name:
        yield
        return
    from helpers.planted_faults import FAULTS

    if name not in FAULTS:
        raise pytest.UsageError(f"MRV2_PLANTED_FAULT={name!r}: planted faults are {', '.join(sorted(FAULTS))}")
    with pytest.MonkeyPatch.context() as mp:
        FAULTS[name](mp)
        yield


# ---- no silent skips under CI -------------------------------------------------------------------------------
STRICT_SKIPS_ENV = "MRV2_CI"  # set by .ci/run
_skips: list[tuple[str, str, bool]] = []  # (nodeid, reason, allowed)


def _record_skip(report) -> None:  # type: ignore[no-untyped-def]
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    from helpers.skip_policy import skip_is_allowed

    _skips.append((report.nodeid, reason, skip_is_allowed(report.nodeid, reason, torch.cuda.is_available())))


def pytest_runtest_logreport(report) -> None:  # type: ignore[no-untyped-def]
    _record_skip(report)


def pytest_collectreport(report) -> None:  # type: ignore[no-untyped-def]
    _record_skip(report)  # module-level skips (pytest.skip(allow_module_level=True), importorskip)


def _is_gpu_only_skip(report) -> bool:  # type: ignore[no-untyped-def]
    from helpers.skip_policy import skip_is_allowed

    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return skip_is_allowed(report.nodeid, reason, torch.cuda.is_available())


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):  # type: ignore[no-untyped-def]
    """Without a GPU, the GPU suite's skips are one line, not one line each in `-ra`'s short summary: they are
    taken out of the reporter's stats while it writes that summary, then put back for the final counts."""
    skipped = terminalreporter.stats.get("skipped", [])
    gpu = [r for r in skipped if _is_gpu_only_skip(r)]
    if gpu:
        terminalreporter.stats["skipped"] = [r for r in skipped if r not in gpu]
    try:
        return (yield)
    finally:
        if gpu:
            terminalreporter.stats["skipped"] = skipped
            terminalreporter.write_line(
                f"{len(gpu)} GPU tests skipped: no CUDA device here (tests/gpu/ runs on a GPU machine)"
            )
        _strict_skips_summary(terminalreporter)


def _strict_skips_summary(terminalreporter) -> None:  # type: ignore[no-untyped-def]
    if not os.environ.get(STRICT_SKIPS_ENV):
        return
    bad = [(nodeid, reason) for nodeid, reason, allowed in _skips if not allowed]
    allowed = len(_skips) - len(bad)
    terminalreporter.write_line(
        f"{STRICT_SKIPS_ENV}: {len(_skips)} skipped, {allowed} of them GPU-only "
        f"(tests/gpu/ without CUDA); {len(bad)} not allowed"
    )
    for nodeid, reason in bad:
        terminalreporter.write_line(f"  skip not allowed: {nodeid}: {reason}", red=True)


def pytest_sessionfinish(session, exitstatus) -> None:  # type: ignore[no-untyped-def]
    if os.environ.get(STRICT_SKIPS_ENV) and any(not allowed for _, _, allowed in _skips) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
