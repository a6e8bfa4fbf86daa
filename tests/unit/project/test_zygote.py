"""The test suite's server zygote (tests/zygote.py): what a fork cannot carry over from the
zygote, a forked server sets itself: its own environment, and OpenMP's thread count (libgomp
read OMP_NUM_THREADS once, when the zygote imported torch)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CODE = (
    "import os, torch\n"
    "from tests.zygote import _become\n"
    "_become({env!r})\n"
    "print(torch.get_num_threads(), sorted(os.environ))\n"
)


@pytest.mark.parametrize(
    ("env", "threads"),
    [({"OMP_NUM_THREADS": "1", "ONLY": "x"}, 1), ({"ONLY": "x"}, len(os.sched_getaffinity(0)))],
)
def test_a_forked_server_takes_its_own_environment_and_thread_count(
    env: dict[str, str], threads: int
) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CODE.format(env=env)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "3", "ZYGOTE_ONLY": "y"},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(None, 1) == [str(threads), f"{sorted(env)!r}\n"], out.stdout
