"""The launcher's state folder and port: a temporary folder is its own and goes at `stop`; a
folder and port the caller names (a restart on the same state) are used as given and kept; the
interpreter that runs the server."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from april_server.launcher import LaunchedServer


def test_a_temporary_state_folder_is_removed_at_stop() -> None:
    server = LaunchedServer()
    assert server.dir.is_dir() and server.log_path == server.dir / "server.log"
    server.stop()  # never started: only the folder to clean up
    assert not server.dir.exists()


def test_a_named_state_folder_and_port_are_used_and_kept(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    server = LaunchedServer(state_dir=tmp_path, port=12345)
    assert (server.dir, server.log_path, server.port) == (tmp_path, tmp_path / "server.log", 12345)
    server.stop()
    assert (tmp_path / "state").is_dir()  # the caller's, with the state a restart needs


def test_the_server_runs_under_the_interpreter_given(tmp_path: Path) -> None:
    """A peer framework's venv (the client only) starts the server from the server's venv."""
    seen: list[list[str]] = []

    class Recording(LaunchedServer):
        def popen(self, args: list[str], log: Any, env: dict[str, str]) -> Any:
            seen.append(args)
            return None

    Recording(state_dir=tmp_path, python="/venvs/server/bin/python").spawn()
    Recording(state_dir=tmp_path).spawn()
    assert seen[0][:3] == ["/venvs/server/bin/python", "-m", "april_server"]
    assert seen[1][0] == sys.executable
