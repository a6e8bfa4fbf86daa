"""The launcher's state folder and port: a temporary folder is its own and goes at `stop`; a
folder and port the caller names (a restart on the same state) are used as given and kept."""

from __future__ import annotations

from pathlib import Path

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
