"""Start a private `april-server` in a child process and stop it afterwards.

For whoever needs a server of its own for a while: april-bench, the tests, the examples, the
GPU check. It lives with the server (the entry layer, beside `cli.py`) because starting an
april-server is the server distribution's business; none of its users depends on another.

The server runs as `python -m april_server` (the caller's interpreter, or `python`: a peer
framework's venv that has only the client starts it from the server's venv) on a free port with
a temporary state dir, in its own session so stopping it reaches SGLang's children. A caller
that restarts a server on the same state (a crash test, a restarted engine) names its folder
and port: a named folder is the caller's, so `stop` leaves it.
`cpus` pins it (and the SGLang processes it starts, which inherit the affinity) to those cores,
e.g. to keep it off the cores a trainer in the same machine uses; by default it is not pinned.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import httpx

STARTUP_TIMEOUT_S = 300.0

# A deliberate stop kills SGLang's scheduler with the rest of the process group; SGLang reads
# that as a crashed child and, by default, sleeps 5 s "to let GPU activity settle" before a
# py-spy dump. Nothing crashed, so the launched server skips those diagnostics (a caller's own
# setting of either variable wins).
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class ServerProcess(Protocol):
    """What the launcher needs of the server's process (a `subprocess.Popen`)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LaunchedServer:
    def __init__(
        self,
        extra_args: list[str] | None = None,
        keep_dir: bool = False,
        env: dict[str, str] | None = None,
        cpus: Sequence[int] | None = None,
        state_dir: Path | None = None,
        port: int | None = None,
        python: str | None = None,
    ) -> None:
        self.cpus = None if cpus is None else set(cpus)
        # The interpreter that runs the server: the caller's by default; another venv's (the
        # server's, from a peer framework's venv that has only the client) when given.
        self.python = python or sys.executable
        self.extra_args = list(extra_args or [])
        self.env = env  # added to this process's environment for the server
        self.keep_dir = keep_dir or state_dir is not None
        self.port = free_port() if port is None else port
        # Holds the server's `--april-state-dir` (`state/`) and its log.
        self.dir = Path(tempfile.mkdtemp(prefix="april-bench-")) if state_dir is None else state_dir
        self.log_path = self.dir / "server.log"
        self.proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.spawn()
        self.wait_healthy(timeout_s)

    def spawn(self) -> None:
        """Start the process and return at once (`wait_healthy` waits for it)."""
        args = [
            self.python,
            "-m",
            "april_server",
            "--port",
            str(self.port),
            "--april-state-dir",
            str(self.dir / "state"),
            "--log-level",
            "warning",
            *self.extra_args,
        ]
        env = {**QUIET_STOP_ENV, **os.environ, **(self.env or {})}
        with open(self.log_path, "ab") as log:
            self.proc = self.popen(args, log, env)

    def popen(self, args: list[str], log: IO[bytes], env: dict[str, str]) -> ServerProcess:
        """The process itself: its own session, so that a stop reaches SGLang's children.
        (The test suite forks its servers instead: tests/zygote.py.)"""
        return subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            preexec_fn=None if self.cpus is None else self._pin,
        )

    def wait_healthy(self, timeout_s: float = STARTUP_TIMEOUT_S, poll_s: float = 0.5) -> None:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"april-server exited early; log tail:\n{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"april-server not healthy after {timeout_s:.0f}s:\n{self.tail()}")

    def _pin(self) -> None:
        """In the child before exec: its cores (inherited by everything it starts)."""
        assert self.cpus is not None
        os.sched_setaffinity(0, self.cpus)

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                    self.proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
            self.proc = None
        if not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> LaunchedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_all(servers: list[LaunchedServer], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Start several servers side by side (their start-ups overlap), then wait for each."""
    for s in servers:
        s.spawn()
    for s in servers:
        s.wait_healthy(timeout_s)
