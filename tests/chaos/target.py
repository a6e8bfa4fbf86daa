"""The server a chaos run drives (`harness.py`): one april-server, or an owner over two engine
servers of which one is killed (-9) and restarted during the run."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from april_server.launcher import LaunchedServer, start_all


@dataclass
class Target:
    url: str
    model_path: str
    vocab_size: int = 0  # of the model (agent groups' turn stops lie in it)
    engines: list[LaunchedServer] = field(default_factory=list)
    procs: list[LaunchedServer] = field(default_factory=list)

    def restart_engine(self, i: int) -> None:
        """kill -9 engine `i` and start it again on its port and state dir."""
        old = self.engines[i]
        port, state = old.port, old.dir
        old.keep_dir = True
        if old.proc is not None:
            os.killpg(old.proc.pid, 9)
            old.proc.wait()
            old.proc = None
        new = LaunchedServer(old.extra_args, env=old.env, state_dir=state, port=port)
        new.start()
        self.engines[i] = new
        self.procs = [new if p is old else p for p in self.procs]


def launch(mode: str) -> Target:
    from april_server.cli import cpu_share_env
    from april_server.models import ensure_tiny_model

    model = str(ensure_tiny_model())
    if mode == "server":
        server = LaunchedServer()
        server.start()
        return Target(server.url, model, vocab_of(model), procs=[server])
    engines = [LaunchedServer(env=cpu_share_env(1)) for _ in range(2)]
    start_all(engines)
    owner = LaunchedServer(["--april-engines", ",".join(e.url for e in engines)])
    owner.start()
    return Target(owner.url, model, vocab_of(model), engines=engines, procs=[*engines, owner])


def vocab_of(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])
