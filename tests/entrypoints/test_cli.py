"""The `mrv2` command in subprocesses: run, multirun, bench, errors, and an installed wheel."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MRV2 = [sys.executable, "-m", "framework.entrypoints.cli"]


def _mrv2(
    *args: str, cwd: Path, exe: list[str] = MRV2, timeout: int = 300, base_env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ if base_env is None else base_env, HYDRA_FULL_ERROR="0", TMPDIR=str(cwd))
    return subprocess.run([*exe, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_run_prints_completions_only_and_is_repeatable(tmp_path):
    first = _mrv2("run", "sampler.max_tokens=8", cwd=tmp_path)
    second = _mrv2("run", "sampler.max_tokens=8", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert first.stdout.count("--- completion") == 3 and "def fibonacci(n):" in first.stdout
    assert "INFO" not in first.stdout and "runner v2" in first.stderr  # logs go to stderr
    assert list(tmp_path.iterdir()) == []  # `run` writes no files


def test_run_with_the_v1_runner_prints_what_v2_prints(tmp_path):
    res = _mrv2("run", "-m", "runner=v1,v2", "sampler.max_tokens=8", "run.show_progress=false", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    v1, v2 = res.stdout.split("=== job 1: runner=v2")
    assert v1.startswith("=== job 0: runner=v1") and v1.count("--- completion") == 3
    assert v1.split("\n", 1)[1] == v2.split("\n", 1)[1]  # greedy: same completions from both runners
    assert "runner v1" in res.stderr and "runner v2" in res.stderr


def test_multirun_sweeps_temperature(tmp_path):
    res = _mrv2(
        "run", "-m", "sampler.temperature=0,0.8", "sampler.max_tokens=6", "run.show_progress=false", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert "=== job 0: sampler.temperature=0" in res.stdout and "=== job 1: sampler.temperature=0.8" in res.stdout
    jobs = res.stdout.split("=== job 1")
    assert jobs[0].split("\n", 1)[1] != jobs[1].split("\n", 1)[1]  # sampling changed the completions


@pytest.mark.parametrize(
    "args, message",
    [
        (["sampler.temprature=1"], "sampler.temprature: unknown key (did you mean 'temperature'?)"),
        (
            ["model=nope"],
            "model=nope: unknown option; available model options: gemma-3-4b, gemma-4-default, gpt-oss-20b, "
            "gpt-oss-20b-mxfp4, hf, "
            "jamba-1024, jamba-tiny, qwen3-0.6b, qwen3-30b-a3b, qwen3-moe-tiny, qwen3_5-0.8b, qwen3_5-35b-a3b, "
            "qwen3_5-tiny, random_tiny, tiny, whisper-tiny",
        ),
        (["scheduler.max_num_seqs=-3"], "scheduler.max_num_seqs: Input should be greater than or equal to 1"),
        (["model=hf", "model.path=/does/not/exist"], "model directory '/does/not/exist' does not exist"),
        (["model.preset=nope"], "unknown model.preset 'nope'; embedded presets: "),
    ],
)
def test_bad_config_exits_with_one_message(tmp_path, args, message):
    res = _mrv2("run", *args, cwd=tmp_path)
    assert res.returncode == 2
    assert message in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


@pytest.mark.parametrize("key", ["bench.output_dir", "hydra.run.dir"])
def test_bench_refuses_an_output_dir_it_cannot_create_before_running(tmp_path, key):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    res = _mrv2("bench", "experiment=smoke", f"{key}={blocker}/out", cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mrv2: error: ") and str(blocker / "out") in lines[0], res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""  # no benchmark ran to be thrown away


PICKY_STATE = """
from model_states.default import DefaultModelState


class PickyModelState(DefaultModelState):
    name = "picky"

    def add_request(self, req_slot, request):
        if request.prompt_len > 8:
            raise ValueError(f"picky refuses a prompt of {request.prompt_len} tokens")
        super().add_request(req_slot, request)
"""


def test_run_selects_an_entry_point_model_state_and_exits_1_when_a_request_fails(tmp_path):
    """A pip-installed plugin (modules plus a .dist-info with entry_points.txt) is selected by name; the request
    its state refuses is printed with finish reason `error`, the other completes, and the status is 1."""
    site_dir = tmp_path / "site"
    info = site_dir / "mrv2_picky-0.1.dist-info"
    info.mkdir(parents=True)
    (site_dir / "mrv2_picky.py").write_text(PICKY_STATE)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mrv2-picky\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[mrv2.model_states]\npicky = mrv2_picky:PickyModelState\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site_dir), str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = _mrv2(
        "run",
        "model.model_state=picky",
        "run.prompts=[hi, 'a prompt far longer than eight tokens']",
        "sampler.max_tokens=4",
        "scheduler.max_num_seqs=1",  # one request a step: the refusal fails one
        "run.show_progress=false",
        cwd=tmp_path,
        base_env=env,
    )
    assert res.returncode == 1, res.stderr
    assert "--- completion 0 (length, 4 tokens) ---" in res.stdout
    assert "--- completion 1 (error, 0 tokens) ---" in res.stdout
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("mrv2: error: 1 of 2 requests failed; completion 1: ") and "picky refuses" in last, last


def test_unknown_command(tmp_path):
    res = _mrv2("frobnicate", cwd=tmp_path)
    assert res.returncode == 2 and "unknown command 'frobnicate'; commands: run, bench, serve" in res.stderr


def test_bench_writes_table_json_and_plot(tmp_path):
    out = tmp_path / "bench_out"
    res = _mrv2("bench", "experiment=smoke", f"bench.output_dir={out}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "out tok/s" in res.stdout and "mrv2 v2" in res.stdout
    data = json.loads((out / "bench.json").read_text())
    assert data["results"][0]["num_requests"] == 8 and data["results"][0]["output_tokens"] > 0
    assert (out / "bench.png").stat().st_size > 0
    ttft = data["results"][0]["ttft_s"]  # the plot's per-request latency distribution
    assert len(ttft) == 8 and ttft == sorted(ttft)
    first = data["results"][0]  # the KV footprint (tests/entrypoints/test_bench_kv_footprint.py checks its values)
    assert first["kv_peak_bytes"] == first["kv_peak_blocks"] * first["kv_block_bytes"] > 0
    assert f"KV footprint at peak: {first['kv_peak_blocks']} blocks" in res.stdout
    assert "forwards run eagerly" not in res.stdout  # on a CPU every forward is eager: no line about graphs


def test_bench_plot_draws_throughput_against_baselines_and_latency_distribution():
    from framework.entrypoints.bench.plot import plot_results
    from framework.entrypoints.bench.throughput import BenchResult

    mrv2 = BenchResult("mrv2 v2", 4, 100, 80, 2.0, ttft_s=[0.01, 0.02, 0.05, 0.2])
    hf = BenchResult("hf generate", 4, 100, 80, 8.0)
    fig = plot_results([mrv2, hf], "t")
    bars, cdf = fig.axes
    assert [t.get_text() for t in bars.get_xticklabels()] == ["mrv2 v2", "hf generate"]
    assert [p.get_height() for p in bars.patches] == [40.0, 10.0]
    assert "per-request" in cdf.get_title() and len(cdf.lines) == 1
    assert list(cdf.lines[0].get_xdata()) == [10.0, 20.0, 50.0, 200.0]


@pytest.mark.slow
def test_wheel_installs_in_fresh_venv_and_runs(tmp_path):
    wheel_dir = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-w", str(wheel_dir)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr
    wheel = next(wheel_dir.glob("mrv2-*.whl"))
    # The shipped model (framework/models/embedded/tiny-code*/, once trained) is package data of the wheel.
    shipped = sorted(
        str(f.relative_to(REPO))
        for f in (REPO / "framework/models/embedded").glob("*/*")
        if f.suffix in (".json", ".safetensors")
    )
    with zipfile.ZipFile(wheel) as zf:
        missing = set(shipped) - set(zf.namelist())
    assert not missing, f"wheel lacks shipped model files: {sorted(missing)}"
    env_dir = tmp_path / "venv"
    # Dependencies (torch, transformers, ...) come from this interpreter's site directories; mrv2 itself only from
    # the wheel. Not system_site_packages: a venv made from a venv's interpreter would see the base interpreter's
    # site-packages, not the outer venv's, where CI's torch is. A .pth of plain directories adds them after the
    # venv's own site-packages (the wheel first) without running their .pth files (an editable mrv2's finder).
    venv.EnvBuilder(system_site_packages=False, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    inner_site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    outer_sites = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    outer_dirs = [d for d in outer_sites if Path(d).is_dir()]
    Path(inner_site, "_outer_site_packages.pth").write_text("\n".join(outer_dirs) + "\n")
    # --ignore-installed: an mrv2 installed outside the venv (e.g. an editable checkout) must not satisfy it.
    inst = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "--ignore-installed", str(wheel)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert inst.returncode == 0, inst.stderr
    work = tmp_path / "elsewhere"
    work.mkdir()
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing may shadow the wheel
    where = subprocess.run(
        [
            str(py),
            "-c",
            "import framework, importlib.resources as r; print(framework.__file__); print(r.files('mrv2_conf'))",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        env=clean_env,
    )
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(env_dir)) for line in where.stdout.split()), where.stdout
    res = _mrv2("run", "sampler.max_tokens=4", cwd=work, exe=[str(env_dir / "bin" / "mrv2")], base_env=clean_env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("--- completion") == 3
    shutil.rmtree(env_dir)


def test_help_speaks_of_mrv2_not_hydra(tmp_path):
    shown = _mrv2("serve", "--help", cwd=tmp_path, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "powered by Hydra" not in shown.stdout
    assert shown.stdout.startswith("mrv2 run | serve | bench") and "docs/configuration.md" in shown.stdout
    assert "speculator: " in shown.stdout and "serve:\n  host: 127.0.0.1" in shown.stdout


def test_a_first_gpu_run_says_it_is_compiling(tmp_path):
    from framework.entrypoints.run_command import first_compile_notice

    assert first_compile_notice(False, tmp_path / "none") is None  # a CPU compiles nothing
    notice = first_compile_notice(True, tmp_path / "none")
    assert notice is not None and "compiling the Triton kernels" in notice and str(tmp_path / "none") in notice
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "kernel").write_text("")
    assert first_compile_notice(True, tmp_path / "warm") is None  # cached: a later run starts at once


def test_conf_dir_falls_back_to_the_source_tree_when_mrv2_conf_is_not_installed(monkeypatch):
    """A bare interpreter with the checkout on PYTHONPATH (no `pip install`) composes from the repo's `conf/`."""
    from importlib import resources

    from framework.entrypoints import cli

    def not_installed(name: str) -> Path:
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(resources, "files", not_installed)
    assert (cli.conf_dir() / "base.yaml").is_file()
