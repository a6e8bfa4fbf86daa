"""SGLang's data-parallel controller on a CPU: wait for requests instead of spinning.

With `--dp-size N` a DataParallelController process reads the tokenizer's socket in a loop of
non-blocking receives (`event_loop`), which keeps one core at 100 % even when idle; on a CPU
that core is one the schedulers compute on. The hook (AFTER `DataParallelController.__init__`)
wraps that socket so a non-blocking receive first waits in zmq's poll, woken at once by the
next message (so no added latency), at most `POLL_MS` (so the loop's watchdog is still fed).
Installed only in a process that has the controller's module loaded, and only on SGLang's CPU
engine (`SGLANG_USE_CPU_ENGINE`): on a GPU machine the stock loop is left alone.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import zmq

POLL_MS = 100
DPC_MODULE = "sglang.srt.managers.data_parallel_controller"


class WaitingSocket:
    """A zmq socket whose non-blocking receives wait for a message first (up to POLL_MS)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)

    def _wait(self, flags: int) -> None:
        if flags & zmq.NOBLOCK:
            self._sock.poll(POLL_MS, zmq.POLLIN)

    def recv_pyobj(self, flags: int = 0) -> Any:
        self._wait(flags)
        return self._sock.recv_pyobj(flags=flags)

    def recv(self, flags: int = 0, **kwargs: Any) -> Any:
        self._wait(flags)
        return self._sock.recv(flags=flags, **kwargs)


def register_dp_hooks() -> None:
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "") not in ("1", "true", "True"):
        return
    if DPC_MODULE not in sys.modules:  # not the controller's process: nothing to hook
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        DPC_MODULE + ".DataParallelController.__init__", _after_init, HookType.AFTER
    )


def _after_init(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    sock = getattr(controller, "recv_from_tokenizer", None)
    if sock is not None and not isinstance(sock, WaitingSocket):
        controller.recv_from_tokenizer = WaitingSocket(sock)
    return result
