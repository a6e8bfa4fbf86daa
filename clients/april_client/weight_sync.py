"""Weights over the wire, the trainer's side: push a model's tensors to april-server,
or to an owner over many engines, by a torch.distributed broadcast instead of a checkpoint on a
shared disk.

    sync = WeightBroadcaster(client)                # gloo for CPU tensors, nccl for CUDA ones
    sync.push(model.named_parameters(), "step-7")   # every step; the first call builds the group

The trainer is rank 0 of a weight-update group whose other ranks are the server's TP ranks (an
owner gives each engine its own offset, so the trainer still broadcasts once). Each push:
1. `GET /april/v1/weights/group`: if this trainer's group is not the one the server's engines are
   in (the server restarted, an engine of an owner restarted or joined, one is down), the group
   is built again over every engine that is up: the server's init and this process's join run
   at the same time (each waits for the other), on a free port of the address the server
   reaches this machine by;
2. `/begin_weight_update`, then `/update_weights_from_distributed` (names, dtypes, shapes, the
   version) while the tensors are broadcast in that order, then `/end_weight_update`.
Running generation is never waited for: the server cuts its segments at the version boundary and
continues them under the new weights, and every segment carries the version that made it.

Needs torch (a trainer has it); importing the rest of `april_client` does not.
"""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

from ._errors import AprilError
from ._sync import AprilClient
from .protocol import WeightGroupInfo

GROUP_NAME = "april_weights"
logger = logging.getLogger("april_client")


def reachable_address(url: str) -> str:
    """This machine's address on the route to `url`'s host (what the server dials back)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, parts.port or 80))  # UDP: picks the route, sends nothing
        return str(s.getsockname()[0])


def free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def join_group(
    backend: str, address: str, port: int, world_size: int, rank: int, name: str, timeout_s: float
) -> Any:
    """This process's member of a weight-update group: its own process group (not the default
    one, which the trainer's own distributed setup may use), rendezvous as SGLang's engines do
    (a TCP store at `address:port`, keys under the group's name)."""
    import importlib
    import inspect

    # torch's own internals (what SGLang's side calls too), typed loosely: they vary by version
    c10d: Any = importlib.import_module("torch.distributed.distributed_c10d")

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(
        c10d.rendezvous(f"tcp://{address}:{port}", rank, world_size, timeout=timeout)
    )
    store.set_timeout(timeout)
    store = c10d.PrefixStore(name, store)
    helper = c10d._new_process_group_helper
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(helper).parameters
        else "pg_options"
    )
    pg, _ = helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class WeightBroadcaster:
    def __init__(
        self,
        client: AprilClient,
        master_address: str | None = None,
        backend: str | None = None,
        group_name: str = GROUP_NAME,
        timeout_s: float = 600.0,
    ) -> None:
        """`master_address`: where the server reaches this trainer (default: this machine's
        address on the route to the server); `backend`: gloo or nccl (default: by the device of
        the first tensor pushed)."""
        self.client = client
        self.master_address = master_address or reachable_address(str(client.base_url))
        self.backend = backend
        self.group_name = group_name  # each group built is named `group_name-<8 hex>`
        self.name = group_name
        self.timeout_s = timeout_s
        self.group: Any = None
        self.world_size = 0
        self.rebuilt = 0  # groups built (the first included): a rejoin after a restart shows

    def push(self, named_tensors: Iterable[tuple[str, Any]], weight_version: str) -> dict[str, Any]:
        """Broadcast these tensors as the new weights, `weight_version` their version."""
        import torch.distributed as dist

        tensors = [(n, t.detach().contiguous()) for n, t in named_tensors]
        if not tensors:
            raise ValueError("no tensors to push")
        backend = self.backend or ("nccl" if tensors[0][1].is_cuda else "gloo")
        self._ensure_group(backend)
        names = [n for n, _ in tensors]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        self.client.begin_weight_update()
        try:
            with ThreadPoolExecutor(1) as pool:
                answer = pool.submit(
                    self.client.update_weights_from_distributed,
                    names,
                    dtypes,
                    shapes,
                    group_name=self.name,
                    weight_version=weight_version,
                )
                for _, t in tensors:
                    dist.broadcast(t, src=0, group=self.group)
                out: dict[str, Any] = answer.result()
        finally:
            self.client.end_weight_update()
        return out

    def _ensure_group(self, backend: str) -> None:
        info: WeightGroupInfo = self.client.weight_group()
        if (
            self.group is not None
            and info.group == self.name
            and info.in_sync
            and info.world_size == self.world_size
        ):
            return
        self._leave(info)
        # A fresh name per group: torch creates a name once per process, and a group a failed
        # or dead trainer left on an engine must not stand in the way.
        self.name = f"{self.group_name}-{uuid.uuid4().hex[:8]}"
        port = free_port(self.master_address)
        world = 1 + info.ranks
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_group(
                    backend, self.master_address, port, world, 0, self.name, self.timeout_s
                )
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                joined["error"] = exc

        # The server's init returns once every rank joined, this one too: both at once. If the
        # server refuses, this raises at once (the join gives up at its timeout, in its thread).
        thread = threading.Thread(target=join, name="april-weight-group-join", daemon=True)
        thread.start()
        self.client.init_weights_update_group(self.master_address, port, world, self.name, backend)
        thread.join(self.timeout_s)
        if "group" not in joined:
            raise RuntimeError(f"joining the weight-update group failed: {joined.get('error')}")
        self.group, self.world_size = joined["group"], world
        self.rebuilt += 1

    def _leave(self, info: WeightGroupInfo) -> None:
        """Out of the group: the engines leave theirs first if it is one of ours (a trainer
        that died left its engines in it), then this process."""
        if info.group is not None and info.group.startswith(self.group_name + "-"):
            try:
                self.client.destroy_weights_update_group(info.group)
            except AprilError as exc:
                logger.warning("april: leaving the weight-update group: %s", exc)
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None

    def close(self) -> None:
        """Leave the group (the server's engines leave it too, those that can be reached)."""
        self._leave(self.client.weight_group())
