"""SGLang's scheduler and detokenizer start from a fork server that imported SGLang already.

SGLang starts its children with `spawn`: each imports SGLang anew (~8 s on a 2-core CPU), and
only after the HTTP process has finished its own import (~9 s), so a start takes ~20 s. Here a
fork server is started *before* the HTTP process imports SGLang; it imports the children's
modules at the same time, on another core, and each child is then forked from it, ready. What
a spawned child would get, a forked one gets too:
- the environment: a child is forked from the server, whose environment is the one the HTTP
  process had when it started the server. `_run_in` gives the child the HTTP process's
  environment at the moment the child is started (SGLang sets variables in between).
- its own start method: SGLang's `spawn`, so what a child starts (the DP controller's ranks) is
  spawned, just as without the fork server.
- a parent that hears a crash: SGLang's children signal their parent (SIGQUIT) when they fail;
  their parent is the fork server here, which passes the signal on to the HTTP process.

CPU only (the machines we can test it on); `APRIL_PRELOAD_CHILDREN=0` turns it off. The one
SGLang seam is `engine._set_envs_and_config`, where SGLang picks `spawn`: AFTER it, we pick
the fork server (a hook like the others, see `door/engine.launch`).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import signal
import socket
import sys
from collections.abc import Callable
from multiprocessing import connection, context, forkserver, resource_tracker
from typing import Any

ENV_SWITCH = "APRIL_PRELOAD_CHILDREN"
# What SGLang's children import: the scheduler (and its model code) and the detokenizer; and
# our scheduler plugin (torch, the KV kernels).
PRELOAD = [
    "april_server.door.preload",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "april_server.door.scheduler_hooks",
]
_IN_SERVER = "APRIL_FORK_SERVER"
_started = False


def start_fork_server() -> bool:
    """Start the fork server now (it imports `PRELOAD` in the background); False when off."""
    global _started
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    if all(name in sys.modules for name in PRELOAD) and _can_fork_fork_server():
        _fork_fork_server()
    else:
        mp.set_forkserver_preload(PRELOAD)
        os.environ[_IN_SERVER] = "1"  # the server's environment only (it copies ours now)
        try:
            forkserver.ensure_running()
        finally:
            del os.environ[_IN_SERVER]
    _started = True
    return True


def _can_fork_fork_server() -> bool:
    """`_fork_fork_server` fills in the state `forkserver.ensure_running` keeps, as Python
    3.11-3.13 keep it (3.14 adds an authentication key): elsewhere the server is spawned."""
    server: Any = forkserver._forkserver
    return sys.version_info < (3, 14) and all(
        hasattr(server, a)
        for a in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid")
    )


def _fork_fork_server() -> None:
    """This process imported the children's modules already (a process forked from one that
    did, as the test suite's servers are): fork the server from it instead of starting a new
    interpreter that would import them again. What `ensure_running` sets up, set up here."""
    resource_tracker.ensure_running()
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")  # type: ignore[attr-defined]
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(alive_w)
            signal.signal(signal.SIGQUIT, _relay_sigquit)
            forkserver.main(listener.fileno(), alive_r, [])
        finally:
            os._exit(0)
    os.close(alive_r)
    listener.close()
    server: Any = forkserver._forkserver
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def register_preload_hooks() -> None:
    """In the HTTP process, after `start_fork_server`: SGLang's children come from it."""
    if not _started:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.entrypoints.engine._set_envs_and_config", _after_set_envs, HookType.AFTER
    )
    pass_environment_to_children()


def pass_environment_to_children() -> None:
    """Every child started from the fork server runs in its starter's environment of then."""
    original = context.ForkServerProcess._Popen
    context.ForkServerProcess._Popen = staticmethod(functools.partial(_popen, original))  # type: ignore[method-assign]


def _after_set_envs(result: Any, *args: Any, **kwargs: Any) -> Any:
    mp.set_start_method("forkserver", force=True)
    return result


def _popen(original: Callable[[Any], Any], process_obj: Any) -> Any:
    """The child runs its target in this process's environment as of now."""
    process_obj._target = functools.partial(_run_in, dict(os.environ), process_obj._target)
    return original(process_obj)


def _run_in(environ: dict[str, str], target: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)  # the server's relay (below) is not ours
    mp.set_start_method("spawn", force=True)
    return target(*args, **kw)


def _relay_sigquit(signum: int, frame: Any) -> None:
    os.kill(os.getppid(), signal.SIGQUIT)


# Imported by the fork server first (PRELOAD): a child's SIGQUIT to its parent reaches the HTTP
# process, as it would if the child had been spawned by it. Elsewhere this import changes nothing.
if os.environ.get(_IN_SERVER) == "1":
    signal.signal(signal.SIGQUIT, _relay_sigquit)
