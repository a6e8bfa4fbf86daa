"""A real `april-server` process for end-to-end tests: the server's launcher, plus kill -9 and
restart on the same state dir."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from april_server.launcher import LaunchedServer


class ServerProc(LaunchedServer):
    def __init__(
        self,
        state_dir: Path,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        own_process: bool = False,
        port: int | None = None,
        python: str | None = None,
    ) -> None:
        super().__init__(extra_args, env=env, state_dir=state_dir, port=port, python=python)
        # `python -m april_server` as users start it, not forked from the suite's zygote
        self.own_process = own_process

    def kill9(self) -> None:
        """Crash it: SIGKILL the whole process group (SGLang's children too), no shutdown."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

    def client(self, timeout: float = 300.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)
