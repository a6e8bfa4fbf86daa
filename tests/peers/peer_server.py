"""An april-server for the peer frameworks' tests, which run in each framework's own venv.

The server runs under the server's interpreter (`APRIL_SERVER_PYTHON`: the project venv's
python, or a wrapper that puts a checkout on PYTHONPATH; by default this interpreter, when it
can import the server), not forked from the suite's zygote: a peer venv has the client and not
the server. `make test-peers` sets it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_proc import ServerProc

PYTHON_ENV = "APRIL_SERVER_PYTHON"


def server_python() -> str:
    python = os.environ.get(PYTHON_ENV)
    if python:
        return python
    if importlib.util.find_spec("sglang") is None:
        pytest.skip(f"no server here: set {PYTHON_ENV} to the server venv's python")
    return sys.executable


def tiny_model_path() -> str:
    """The embedded tiny model, built by the server's own code (its venv has what it needs)."""
    import subprocess

    out = subprocess.run(
        [
            server_python(),
            "-c",
            "from april_server.models import ensure_tiny_model as e; print(e())",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def peer_server(state: Path) -> Iterator[ServerProc]:
    proc = ServerProc(state_dir=state, own_process=True, python=server_python())
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
