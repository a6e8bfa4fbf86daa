"""Run context of the gpu-check: the time budget and child processes with timeouts. Shared by
the kernel parts here and the harness above (`april_bench.gpu_check`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # kernels/gpu_check/run.py
MARGIN_S = 10.0  # kept back from every part for writing the report and stopping the server


@dataclass
class CmdResult:
    command: list[str]
    returncode: int | None  # None: killed at its timeout
    seconds: float
    output: str  # stdout and stderr together

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    def summary(self) -> dict[str, Any]:
        return {
            "command": shown(self.command),
            "returncode": self.returncode,
            "seconds": round(self.seconds, 1),
            "output_tail": self.tail(),
        }


@dataclass
class Context:
    dry_run: bool
    cuda: bool
    out_dir: Path
    budget_s: float
    started: float = field(default_factory=time.monotonic)

    def seconds_left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started) - MARGIN_S

    def allow(self, limit_s: float) -> float:
        """A part's timeout: its own limit, cut to what is left of the whole run's budget."""
        return max(0.0, min(limit_s, self.seconds_left()))

    def python(self, *args: str) -> list[str]:
        return [sys.executable, *args]


def shown(command: list[str]) -> str:
    """A command as a reader would type it: `python` for this interpreter, paths relative."""
    words = ["python" if w == sys.executable else w.replace(f"{ROOT}/", "") for w in command]
    return " ".join(words)


def child_env(interpret: bool | None = None) -> dict[str, str]:
    """This environment with the repository importable; TRITON_INTERPRET set (True), removed
    (False) or left as it is (None)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    if interpret is True:
        env["TRITON_INTERPRET"] = "1"
    elif interpret is False:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_cmd(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> CmdResult:
    """Run in its own session; at the timeout the whole process group is killed."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env or child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 1.0))
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[killed at its {timeout_s:.0f} s timeout]"
        code = None
    return CmdResult(command, code, time.monotonic() - t0, out)
