"""An owner april-server over two engine servers on this CPU, for the fleet's end-to-end tests
(`test_fleet_e2e.py`, `test_moe_fleet_e2e.py`), and the helpers they share: the engines an
owner shows, waiting for a state, and a real sgl-model-gateway with the engines registered."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from april_server.cli import cpu_share_env
from april_server.launcher import free_port, start_all
from tests.e2e.test_rollouts_e2e import R, clear_buffer, ok
from tests.server_proc import ServerProc

KV_BYTES = 128 * 1024**2  # each engine's snapshot budget (by default)


class Fleet:
    def __init__(self, root: Path, engine_args: list[str] | None = None) -> None:
        """Two engine servers started side by side with `engine_args` (by default a snapshot
        budget of KV_BYTES each) and an owner over them."""
        self.root = root
        args = ["--april-kv-host-bytes", str(KV_BYTES)] if engine_args is None else engine_args
        # One OpenMP thread each: two engines with a thread per core each spin against each
        # other on these 2 cores (cli.cpu_share_env), several times slower.
        self.engines = [
            ServerProc(self._dir(f"engine{i}"), args, cpu_share_env(1)) for i in range(2)
        ]
        start_all(list(self.engines))  # side by side: their start-ups overlap
        self.owner = ServerProc(self._dir("owner"), ["--april-engines", self.urls])
        self.owner.start()

    @property
    def urls(self) -> str:
        return ",".join(e.url for e in self.engines)

    @contextlib.contextmanager
    def another_owner(self, name: str, args: list[str]) -> Iterator[ServerProc]:
        """One more owner (its own state dir `name`), stopped when the block ends."""
        owner = ServerProc(self._dir(name), args)
        owner.start()
        try:
            yield owner
        finally:
            owner.stop()

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(exist_ok=True)
        return d

    def name(self, i: int) -> str:
        return f"127.0.0.1:{self.engines[i].port}"

    def restart(self, i: int) -> None:
        """Start engine `i` again on its port (a fresh process: no snapshots, first weights)."""
        old = self.engines[i]
        e = ServerProc(old.dir, old.extra_args, old.env, port=old.port)
        e.start()
        self.engines[i] = e

    def stop(self) -> None:
        for p in [self.owner, *self.engines]:
            p.stop()


@contextlib.contextmanager
def cleared_owner(fleet: Fleet) -> Iterator[httpx.Client]:
    """A client of the owner over an empty buffer; whatever the test left is aborted and
    deleted when the block ends."""
    with fleet.owner.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def engines(http: httpx.Client) -> dict[str, Any]:
    return {e["engine"]: e for e in ok(http.get(R + "/stats"))["engine"]["engines"]}


def wait_for(what: str, check: Any, timeout_s: float = 120.0, detail: Any = None) -> None:
    """`detail`: what to show on a timeout (the last state seen)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        seen = f"; last seen: {detail()}" if detail is not None else ""
        assert time.monotonic() < deadline, f"timed out waiting for {what}{seen}"
        time.sleep(0.2)


@contextlib.contextmanager
def smg_over(fleet: Fleet) -> Iterator[str]:
    """A real sgl-model-gateway (PyPI `smg`) with both engines registered in it."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("smg")
    proc = subprocess.Popen(
        [
            str(exe),
            "launch",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(metrics_port),
            "--health-check-interval-secs",
            "1",
            "--shutdown-grace-period-secs",
            "0",
            "--log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for("smg", lambda: answers(url + "/liveness"), 30)
        for e in fleet.engines:
            r = httpx.post(url + "/workers", json={"url": e.url})
            assert r.status_code == 202, r.text
        listed = lambda: len(httpx.get(url + "/workers").json()["workers"]) == 2  # noqa: E731
        wait_for("both engines listed in smg", listed, 60)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
