"""Test servers forked from one process that imported SGLang once (a "zygote").

A real `april-server` start on our 2-core CPU is ~14 s, ~12 of them importing SGLang: the HTTP
process's import on one core and the fork server's (`door/preload.py`) on the other. The suite
starts ~15 servers. Here one process does the same set-up and imports as `cli.main` once; each
server is then a fork of it that runs `cli.main(argv)`: the same code from the same point on,
with its own environment, log, session and cores. Its fork server is forked too
(`preload.start_fork_server` forks when the children's modules are imported already), so the
server's children still come from a fork server as in production.

What a fork cannot give a server, the child sets itself: the environment (swapped in before
`cli.main`, which reads it), OpenMP's thread count (libgomp read `OMP_NUM_THREADS` when torch
was imported, in the zygote; the child calls `torch.set_num_threads`) and the `sgl_kernel`
shim on PYTHONPATH (what SGLang spawns, e.g. DP ranks, imports it from there).

`APRIL_TEST_ZYGOTE=0` starts every server as its own process instead (`python -m april_server`).
The zygote is started at the first server start of a test session and stopped at its end.
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
from multiprocessing.connection import Client, Connection
from pathlib import Path
from typing import IO, Any

ENV_SWITCH = "APRIL_TEST_ZYGOTE"
# What `python -m april_server` imports before it serves: cli.main's own import of the door
# and SGLang's HTTP entry point (door/engine.launch), and the fork server's preload.
IMPORTS = [
    "april_server.cli",
    "april_server.door.engine",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.plugins",
    "sglang.srt.server_args",
]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


class ZygoteChild:
    """The parts of `subprocess.Popen` a launcher uses, for a server forked by the zygote
    (its parent is the zygote, so the zygote reaps it and reports its exit)."""

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.request("poll", self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"zygote child {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


class Zygote:
    """The zygote process, started on first use; `popen` is a drop-in for the launcher's."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = str(Path(tempfile.mkdtemp(prefix="april-zygote-")) / "socket")

    def popen(self, args: list[str], log: IO[bytes], env: dict[str, str], cpus: Any) -> ZygoteChild:
        assert args[1:3] == ["-m", "april_server"], args
        if self.proc is None:
            self._start()
        pid = self.request("start", (args[3:], env, log.name, os.getcwd(), cpus))
        return ZygoteChild(self, pid)

    def request(self, what: str, arg: Any) -> Any:
        with Client(self.address, family="AF_UNIX") as conn:
            conn.send((what, arg))
            answer = conn.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.zygote", self.address],
            start_new_session=True,
            cwd=Path(__file__).resolve().parents[1],  # where `tests` is a package
        )
        deadline = time.monotonic() + 300
        while True:  # its socket answers once its imports are done
            try:
                self.request("ping", None)
                return
            except (FileNotFoundError, ConnectionRefusedError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "the test zygote did not start (its output is above)"
                    ) from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None
        shutil.rmtree(Path(self.address).parent, ignore_errors=True)


# --- the zygote process ---------------------------------------------------------------------


def _prepare() -> None:
    """What `cli.main` does before it imports SGLang, then the imports."""
    import importlib

    from april_server import cli
    from april_server.door.preload import PRELOAD

    cli.prepare_sglang_env(cpu=True)
    for name in IMPORTS + PRELOAD:
        importlib.import_module(name)


def _serve(address: str) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    listener.listen()
    while True:
        with Connection(listener.accept()[0].detach()) as conn:
            what, arg = conn.recv()
            try:
                if what == "start":
                    answer: Any = _fork_server(*arg, inherited=(listener, conn))
                elif what == "poll":
                    answer = _poll(arg)
                elif what == "ping":
                    answer = None
                else:
                    answer = ValueError(f"unknown request {what!r}")
            except Exception as e:  # answered, not raised: the zygote serves on
                answer = e
            conn.send(answer)


def _poll(pid: int) -> int | None:
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return -1  # reaped already: reported once, gone since
    return None if done == 0 else os.waitstatus_to_exitcode(status)


def _fork_server(
    argv: list[str], env: dict[str, str], log: str, cwd: str, cpus: Any, inherited: Any
) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        for end in inherited:  # the zygote's socket is the zygote's alone
            end.close()
        os.setsid()
        log_fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.chdir(cwd)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        _become(env)
        sys.argv = ["april-server", *argv]
        from april_server.cli import main

        main(argv)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return 0  # not reached


def _become(env: dict[str, str]) -> None:
    """The server's own environment, and what the zygote's imports fixed from its own."""
    import torch

    from april_server import cli

    os.environ.clear()
    os.environ.update(env)
    shim = str(cli.SHIM_DIR)
    if shim in sys.path and shim not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = shim + (os.pathsep + old if old else "")
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    threads = os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(int(threads) if threads else len(os.sched_getaffinity(0)))


if __name__ == "__main__":
    _prepare()
    _serve(sys.argv[1])
