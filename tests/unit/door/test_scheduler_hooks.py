"""SchedulerKv's restore over fake pools, in a subprocess (scheduler_kv_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_restore_frees_its_slots_on_failure_and_keeps_its_namespace() -> None:
    script = Path(__file__).with_name("scheduler_kv_check.py")
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "scheduler kv check OK" in proc.stdout
