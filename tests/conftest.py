"""Shared test set-up.

- Triton kernels run in the interpreter when there is no CUDA device; the variable must be set
  before any kernel is decorated, hence here, at import.
- `gpu`-marked tests are skipped, with a reason, without CUDA.
- servers are forked from one process that imported SGLang once (tests/zygote.py).
- `tiny_server`: one real april-server (real SGLang scheduler on CPU, embedded tiny model)
  per test session, started as users start it (~15 s).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from typing import IO, Any

import pytest

try:
    import torch

    HAS_CUDA = bool(torch.cuda.is_available())
except ImportError:  # the client-only tests run without torch
    torch = None  # type: ignore[assignment]
    HAS_CUDA = False

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from april_server.launcher import LaunchedServer  # noqa: E402
from tests import zygote  # noqa: E402
from tests.server_proc import ServerProc  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_rngs() -> None:
    random.seed(0)
    if torch is not None:
        torch.manual_seed(0)


@pytest.fixture(scope="session", autouse=True)
def _servers_forked_from_a_zygote() -> Iterator[None]:
    """Every server a test starts (through the launcher: ServerProc, the bench, the fleet) is
    forked from one process that imported SGLang once (tests/zygote.py); started on first use.
    The exception, `tiny_server`, which most tests use, is started as users start it."""
    if not zygote.enabled():
        yield
        return
    z = zygote.Zygote()
    original = LaunchedServer.popen

    def popen(self: LaunchedServer, args: list[str], log: IO[bytes], env: dict[str, str]) -> Any:
        if getattr(self, "own_process", False):
            return original(self, args, log, env)
        return z.popen(args, log, env, self.cpus)

    LaunchedServer.popen = popen  # type: ignore[method-assign]
    try:
        yield
    finally:
        LaunchedServer.popen = original  # type: ignore[method-assign]
        z.stop()


@pytest.fixture(scope="session")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> ServerProc:
    """A real server on the embedded tiny model with a durable state dir (and SGLang's own
    metrics on, so `/metrics` is tested with both sets of families)."""
    state = tmp_path_factory.mktemp("april-state")
    # Its scheduler takes the tests' injected aborts (door/fault_hooks.py), nothing else does.
    os.environ["APRIL_FAULT_INJECTION"] = "1"
    proc = ServerProc(
        state_dir=state, extra_args=["--april-allow-stale-kv", "--enable-metrics"], own_process=True
    )
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def _weights_server_proc(tmp_path_factory: pytest.TempPathFactory) -> ServerProc:
    proc = ServerProc(state_dir=tmp_path_factory.mktemp("april-weights-state"))
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture()
def weights_server(_weights_server_proc: ServerProc) -> ServerProc:
    """A server for the tests that change its weights (TRL runs, pushes over the wire), shared
    by them, not tiny_server: each test gets it with the tiny model's weights, and gives them
    back when it ends (pushed from disk)."""
    yield _weights_server_proc
    from april_server.models import ensure_tiny_model

    body = {"model_path": str(ensure_tiny_model()), "weight_version": "reset"}
    with _weights_server_proc.client() as c:
        assert c.post("/update_weights_from_disk", json=body).status_code == 200
