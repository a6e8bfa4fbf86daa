"""The fork server SGLang's children start from (door/preload.py), without SGLang: a child
sees its starter's environment as of its start (not the server's older copy), spawns what it
starts (SGLang's own method), and its SIGQUIT to its parent reaches the starting process.
Run in a fresh interpreter: the start method and the fork server are process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent(
    """
    import multiprocessing as mp, os, signal, time
    from april_server.door import preload


    def child(q, starter):
        env = os.environ
        q.put((env.get("SET_LATER"), "APRIL_FORK_SERVER" in env, mp.get_start_method(),
               os.getppid() != starter))
        os.kill(os.getppid(), signal.SIGQUIT)  # what a failing SGLang child does


    if __name__ == "__main__":
        preload.PRELOAD[:] = PRELOAD  # not SGLang: the mechanism only
        assert preload.start_fork_server()
        preload.pass_environment_to_children()
        preload._after_set_envs(None)  # the hook after SGLang's _set_envs_and_config
        os.environ["SET_LATER"] = "yes"  # SGLang sets variables after the server started
        heard = []
        signal.signal(signal.SIGQUIT, lambda *a: heard.append(1))
        q = mp.Queue()
        p = mp.Process(target=child, args=(q, os.getpid()))
        p.start()
        answer = q.get(timeout=60)  # the server runs, exec'd if it was spawned
        server = mp.forkserver._forkserver._forkserver_pid
        with open(f"/proc/{server}/cmdline", "rb") as f:
            print("spawned" if b"forkserver" in f.read() else "forked")
        print(answer)
        p.join(60)
        deadline = time.monotonic() + 30
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        print("heard", bool(heard), "exit", p.exitcode)
    """
)


@pytest.mark.parametrize(
    ("preload", "server"),
    [
        # The server imports what the starter has not imported (a server start): spawned.
        (["april_server.door.preload", "tabnanny"], "spawned"),
        # The starter imported it all already (a test server forked from tests/zygote.py):
        # the server is forked from the starter.
        (["april_server.door.preload"], "forked"),
    ],
)
def test_a_forked_child_gets_the_starters_environment_and_its_sigquit_reaches_it(
    tmp_path: Path, preload: list[str], server: str
) -> None:
    script = tmp_path / "starter.py"
    script.write_text(f"PRELOAD = {preload!r}\n" + SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    # The environment of the moment, without the server's marker; spawn for its own children;
    # its parent is the fork server (not the starter), which relays the SIGQUIT.
    lines = out.stdout.splitlines()
    assert lines == [server, "('yes', False, 'spawn', True)", "heard True exit 0"], out


def test_off_switch() -> None:
    code = (
        "import os; os.environ['APRIL_PRELOAD_CHILDREN'] = '0'\n"
        "from april_server.door import preload; print(preload.start_fork_server())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out
