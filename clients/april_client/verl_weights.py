"""verl's weights to april-server: a checkpoint-engine backend, `april` (for `verl.py`).

verl moves weights from its actor to its rollout through a checkpoint engine: on the actor,
`await engine.send_weights(actor.get_per_tensor_param(), global_steps=k)`
(`verl/checkpoint_engine/base.py`). With

    actor_rollout_ref.rollout.checkpoint_engine.backend=april
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=april_client.verl_weights
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.april.url=http://host:port

the actor's tensors go to april-server as weight version `str(global_steps)`: over a
torch.distributed group whose other ranks are the server's (`weight_sync.WeightBroadcaster`:
gloo for CPU tensors, nccl for CUDA ones; `mode="distributed"`, the default), or saved as a
safetensors checkpoint beside the model's config and loaded with `/update_weights_from_disk`
(`mode="disk"`, `weights_dir` readable by the server). The server cuts its running segments at
the version boundary and continues them: nothing waits for generation to stop.

verl imports this module (its `custom_backend_module`) so that the backend registers; without
verl installed the module still imports, and the engine is an error naming verl when used.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from ._framework import MissingFramework, framework
from ._sync import AprilClient
from .weight_sync import WeightBroadcaster

BACKEND = "april"
MODEL_FILES = ("config.json", "generation_config.json")


def push_weights(
    client: AprilClient,
    weights: Iterable[tuple[str, Any]],
    version: str,
    *,
    mode: Literal["distributed", "disk"] = "distributed",
    broadcaster: WeightBroadcaster | None = None,
    weights_dir: str | None = None,
    model_path: str | None = None,
) -> dict[str, Any]:
    """Push `(name, tensor)` pairs to the server as weight version `version`."""
    if mode == "distributed":
        if broadcaster is None:
            raise ValueError("mode='distributed' needs a WeightBroadcaster")
        return broadcaster.push(weights, version)
    if mode != "disk":
        raise ValueError(f"mode must be 'distributed' or 'disk', got {mode!r}")
    if model_path is None:
        raise ValueError("mode='disk' needs model_path (its config.json goes beside the weights)")
    safetensors = framework("safetensors.torch")
    root = Path(weights_dir or tempfile.mkdtemp(prefix="april-verl-weights-"))
    path = root / f"step-{version}"
    path.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in weights}
    safetensors.save_file(tensors, str(path / "model.safetensors"))
    for name in MODEL_FILES:
        if (Path(model_path) / name).exists():
            shutil.copy(Path(model_path) / name, path / name)
    return client.update_weights_from_disk(str(path), weight_version=version)


@functools.cache
def engine_class() -> type:
    """verl's `CheckpointEngine` that sends to april-server, registered as backend `april`."""
    base = framework("verl.checkpoint_engine.base")

    @base.CheckpointEngineRegistry.register(BACKEND)
    class AprilCheckpointEngine(base.CheckpointEngine):  # type: ignore[misc,name-defined]
        """The actor's side only: the server receives the weights itself."""

        def __init__(
            self,
            bucket_size: int = 0,
            url: str | None = None,
            mode: Literal["distributed", "disk"] = "distributed",
            weights_dir: str | None = None,
            model_path: str | None = None,
            is_master: bool = True,
            **kwargs: Any,
        ) -> None:
            if url is None:
                raise ValueError(
                    "the april checkpoint engine needs the server's address: "
                    "checkpoint_engine.engine_kwargs.april.url"
                )
            self.client = AprilClient(url, timeout=600.0)
            self.mode = mode
            self.weights_dir = weights_dir
            self.model_path = model_path
            self.is_master = is_master
            self.broadcaster = WeightBroadcaster(self.client) if mode == "distributed" else None

        def prepare(self) -> dict[str, Any]:
            return {}

        @classmethod
        def build_topology(
            cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
        ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
            # The server's ranks join the weight group the broadcaster builds, not verl's.
            return (
                {"rank": list(range(actor_wg_world_size))},
                {"rank": list(range(rollout_world_size))},
            )

        def init_process_group(self, **kwargs: Any) -> None:
            pass

        def finalize(self) -> None:
            pass

        async def send_weights(
            self, weights: Any, global_steps: int | None = None
        ) -> dict[str, Any]:
            if not self.is_master:
                for _ in weights:  # other actor ranks: nothing to send, the generator drains
                    pass
                return {}
            if global_steps is None:
                raise ValueError("april-server needs the weights' version: pass global_steps")
            version = str(global_steps)
            answer = await asyncio.to_thread(
                push_weights,
                self.client,
                weights,
                version,
                mode=self.mode,
                broadcaster=self.broadcaster,
                weights_dir=self.weights_dir,
                model_path=self.model_path,
            )
            if not answer.get("success", False):
                raise RuntimeError(f"weight push for step {version} failed: {answer}")
            return {}

        async def receive_weights(self, global_steps: int | None = None) -> Any:
            raise NotImplementedError("april-server receives the weights itself")

    return AprilCheckpointEngine


def __getattr__(name: str) -> Any:
    if name == "AprilCheckpointEngine":
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


try:  # imported by verl as its custom_backend_module: register the backend now
    engine_class()
except MissingFramework:
    pass
