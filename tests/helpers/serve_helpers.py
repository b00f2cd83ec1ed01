"""A real `mrv2 serve` on 127.0.0.1 at a free port, for the server tests; always stopped by the test that starts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import httpx
import pytest

if TYPE_CHECKING:
    import openai

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300  # a loaded 2-core machine can take minutes to load the model


class ServerProcess:
    """`python -m framework.entrypoints.cli serve serve.port=0 OVERRIDES...`; `url` comes from its one stdout line."""

    def __init__(self, *overrides: str) -> None:
        self.overrides = ["serve.port=0", "device=cpu", *overrides]
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self._stderr = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: nobody must drain it

    def __enter__(self) -> "ServerProcess":
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # One torch thread unless told otherwise: the tiny model's ops are too small to split, and on a busy
        # 2-core machine two threads wait on each other at every op (a decode step goes from ms to tens of ms).
        env.setdefault("OMP_NUM_THREADS", "1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "framework.entrypoints.cli", "serve", *self.overrides],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until the URL line (or EOF when start-up failed)
        if not line.startswith("mrv2 serve: http://") or time.monotonic() > deadline:
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}\n{self.stderr_tail()}")
        self.url = line.split()[2]
        return self

    def stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()[-3000:]

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def engine_pid(self) -> int:
        """The engine-core process: the server's child running framework.entrypoints.serve.engine_core."""
        assert self.proc is not None
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"framework.entrypoints.serve.engine_core" in cmdline:
                return int(entry.name)
        raise RuntimeError("no engine-core process found")

    def get(self, path: str, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
        return httpx.get(f"{self.url}{path}", timeout=30, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:  # type: ignore[no-untyped-def]
        return httpx.post(f"{self.url}{path}", timeout=60, **kwargs)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> Optional[int]:
        """Send `sig`, wait up to `timeout` s for exit (then kill); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return None
        return self.proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self._stderr.close()


def openai_client(server: ServerProcess, api_key: str = "unused", timeout: float = 60) -> openai.OpenAI:
    """The official `openai` client against `server`, without retries: a test sees the server's first answer."""
    import openai

    return openai.OpenAI(base_url=server.base_url, api_key=api_key, max_retries=0, timeout=timeout)


def module_server(*overrides: str):  # type: ignore[no-untyped-def]
    """A module-scoped fixture: one `mrv2 serve` (with Hydra `overrides`) for the module's tests.
    Use as `server = module_server(...)` at module level."""

    @pytest.fixture(scope="module")
    def server():  # type: ignore[no-untyped-def]
        with ServerProcess(*overrides) as s:
            yield s

    return server
