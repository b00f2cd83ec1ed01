"""The `mrv2` command: `mrv2 run`, `mrv2 bench` and `mrv2 serve` (each `[overrides...]`), all Hydra apps.

Any config key can be overridden (`sampler.temperature=0.8`), groups switched (`model=qwen3-0.6b`) and
`-m` sweeps several values. stdout carries only results; logs, warnings and progress go to stderr.
A bad config or bad input exits with status 2 and one readable message; `mrv2 run` exits with status 1
when a request ended in an error (its completion is printed with finish reason `error`).
"""

from __future__ import annotations

import os
import sys
from importlib import resources
from pathlib import Path
from typing import Callable, Optional

from framework.config.schema import ConfigError

USAGE = """usage: mrv2 {run,bench,serve} [HYDRA OVERRIDES...]

  mrv2 run                              complete the default prompts with the embedded tiny model
  mrv2 run sampler=random sampler.max_tokens=64
  mrv2 run -m sampler.temperature=0,0.8  (multirun: one job per value)
  mrv2 bench experiment=nano             the "nano" throughput workload (needs a GPU to finish quickly)
  mrv2 run task=embed                   embed the prompts instead (one line per prompt)
  mrv2 bench experiment=embed_bench     embedding throughput, mrv2 vs HF transformers
  mrv2 bench experiment=serve_nano      the "nano" requests through mrv2 serve (streaming HTTP) vs offline
  mrv2 bench experiment=prefix_bench    a shared 2,000-token system prompt, prefix caching off vs on
  mrv2 bench experiment=prefix_bench_hybrid   the same on the Mamba hybrid (jamba-1024)
  mrv2 bench experiment=qwen3_5         nano on the Qwen3.5-0.8B geometry (Gated DeltaNet hybrid)
  mrv2 bench experiment=prefix_bench_qwen3_5  the shared-prompt workload on it (DeltaNet snapshots)
  mrv2 bench experiment=multiturn       64 conversations x 8 turns over 8K contexts, host KV tier off vs on
  mrv2 bench experiment=gemma3_long cache.kv_groups=true   KV bytes per token at 32K (then =false)
  mrv2 serve                            an OpenAI-compatible server on 127.0.0.1:8000 (docs/serving.md)
  mrv2 serve serve.port=9000 serve.api_key=secret model=hf model.path=/path/to/hf-dir
  mrv2 run --cfg job                     print the composed config
"""


def conf_dir() -> Path:
    """The Hydra tree: package `mrv2_conf` once installed (it is the repo's `conf/`), else the source tree's."""
    try:
        return Path(str(resources.files("mrv2_conf")))
    except ModuleNotFoundError:  # running from a source checkout on PYTHONPATH, not installed
        return Path(__file__).resolve().parents[2] / "conf"


def _user_errors() -> tuple[type[BaseException], ...]:
    from framework.config.registry import RegistryError
    from framework.models.hf_config import UnsupportedModelError
    from framework.models.loader import CheckpointError
    from framework.params.sampling_params import InvalidRequestError

    return (ConfigError, InvalidRequestError, CheckpointError, UnsupportedModelError, RegistryError)


def _fail(message: str) -> None:
    print(f"mrv2: error: {message}", file=sys.stderr)
    sys.exit(2)


def hydra_error_line(err: BaseException) -> str:
    """Hydra's (or OmegaConf's) error as one line: its unindented lines and its cause's, without the advice
    to set HYDRA_FULL_ERROR (e.g. "Could not override 'speculator.dynamic'. ...: Key 'dynamic' is not in struct")."""
    parts: list[str] = []
    seen: Optional[BaseException] = err
    while seen is not None and len(parts) < 4:
        parts += [
            line.strip()
            for line in str(seen).splitlines()
            if line.strip() and not line[:1].isspace() and "HYDRA_FULL_ERROR" not in line
        ]
        seen = seen.__cause__
    return f"invalid config: {': '.join(dict.fromkeys(parts)) or type(err).__name__}"


def _hydra_app(config_name: str, task: Callable[[object], None], started: list[bool]) -> Callable[[], None]:
    """The Hydra app of one command; each job appends to `started` as it begins."""
    import hydra
    from omegaconf.errors import OmegaConfBaseException

    from framework.config.hydra_defaults import register_schema_defaults

    register_schema_defaults()  # `conf/base.yaml` composes the schema's defaults first

    def guarded(cfg: object) -> None:
        started.append(True)
        try:
            task(cfg)
        except _user_errors() as err:
            _fail(str(err))
        except OmegaConfBaseException as err:  # e.g. an interpolation that resolves to nothing
            _fail(hydra_error_line(err))

    return hydra.main(config_path=str(conf_dir()), config_name=config_name, version_base=None)(guarded)


def _run_task(cfg: object) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from framework.config.schema import load_config
    from framework.entrypoints.run_command import run_command

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:  # tell the jobs apart on stdout
        print(f"=== job {hydra_cfg.job.num}: {' '.join(hydra_cfg.overrides.task) or '(defaults)'} ===")
    config = load_config(cfg)
    failed = run_command(config)
    if failed:  # the completions are printed; the status says that some are not what was asked for
        print(f"mrv2: error: {len(failed)} of {len(config.run.prompts)} requests failed; {failed[0]}", file=sys.stderr)
        sys.exit(1)


def _writable_dir(path: Path, key: str) -> Path:
    """`path`, created if need be; checked before a benchmark runs, which may take hours, not after it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"{key}={path}: cannot create the directory: {err.strerror or err}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path}: the directory is not writable")
    return path


def _bench_task(cfg: object) -> None:
    from hydra.core.hydra_config import HydraConfig

    from framework.config.schema import load_config
    from framework.entrypoints.bench.throughput import run_bench

    config = load_config(cfg)
    key = "bench.output_dir" if config.bench.output_dir else "hydra.run.dir"
    out_dir = _writable_dir(Path(config.bench.output_dir or HydraConfig.get().runtime.output_dir), key)
    if config.task == "embed":
        from framework.entrypoints.bench.embed import run_embed_bench

        run_embed_bench(config, out_dir)
        return
    if config.bench.serve:
        from framework.entrypoints.bench.serve import run_serve_bench

        run_serve_bench(config, out_dir)
        return
    if config.bench.num_turns:
        from framework.entrypoints.bench.multiturn import run_multiturn_bench

        run_multiturn_bench(config, out_dir)
        return
    if config.bench.shared_prefix_len:
        from framework.entrypoints.bench.prefix import run_prefix_bench

        run_prefix_bench(config, out_dir)
        return
    run_bench(config, out_dir)


def _serve_task(cfg: object) -> None:
    from framework.config.schema import load_config
    from framework.entrypoints.serve.server import serve_command

    serve_command(load_config(cfg))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `mrv2` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    tasks = {"run": _run_task, "bench": _bench_task, "serve": _serve_task}
    if command not in tasks:
        _fail(f"unknown command '{command}'; commands: run, bench, serve")
    overrides = [a for a in rest if not a.startswith("-") and "=" in a]
    try:
        from framework.config.overrides import check_overrides

        check_overrides(overrides, conf_dir())
    except ConfigError as err:
        _fail(str(err))
    sys.argv = [f"mrv2 {command}", *rest]
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    previous = os.environ.get("HYDRA_FULL_ERROR")
    user_wants_traces = previous == "1"  # as Hydra reads it: HYDRA_FULL_ERROR=0 means one line
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises its errors instead of printing several lines
    started: list[bool] = []
    try:
        _hydra_app(command, tasks[command], started)()
    except (HydraException, OmegaConfBaseException) as err:  # what the override check above did not catch
        if user_wants_traces:
            raise
        _fail(hydra_error_line(err))
    except OSError as err:  # before any job: Hydra could not create its output directory
        if user_wants_traces or started:
            raise
        _fail(f"cannot create Hydra's output directory (hydra.run.dir, or hydra.sweep.dir with -m): {err}")
    finally:
        if previous is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


if __name__ == "__main__":
    main()
