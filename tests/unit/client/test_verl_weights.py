"""verl's weights to the server (`april_client.verl_weights`): the disk path writes a checkpoint
the server can load and names the version; the distributed path goes through the broadcaster;
without verl the checkpoint engine names what to install. The `april` backend inside verl is
driven by tests/peers/test_verl_e2e.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from april_client import verl_weights
from april_client._framework import MissingFramework


class FakeClient:
    def __init__(self) -> None:
        self.loaded: list[tuple[str, str | None]] = []

    def update_weights_from_disk(
        self, path: str, weight_version: str | None = None
    ) -> dict[str, Any]:
        self.loaded.append((path, weight_version))
        return {"success": True}


def test_disk_pushes_a_loadable_checkpoint_with_the_version(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors = pytest.importorskip("safetensors.torch")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    client = FakeClient()
    weights = [("w", torch.ones(2, 3)), ("b", torch.zeros(3))]
    out = verl_weights.push_weights(
        client,  # type: ignore[arg-type]
        iter(weights),
        "7",
        mode="disk",
        weights_dir=str(tmp_path / "out"),
        model_path=str(model),
    )
    assert out == {"success": True}
    ((path, version),) = client.loaded
    assert version == "7" and Path(path) == tmp_path / "out" / "step-7"
    assert json.loads((Path(path) / "config.json").read_text()) == {"model_type": "llama"}
    saved = safetensors.load_file(str(Path(path) / "model.safetensors"))
    assert set(saved) == {"w", "b"} and bool((saved["w"] == 1).all())


def test_distributed_goes_through_the_broadcaster() -> None:
    class Broadcaster:
        def push(self, weights: Any, version: str) -> dict[str, Any]:
            return {"success": True, "version": version, "n": len(list(weights))}

    out = verl_weights.push_weights(
        FakeClient(),  # type: ignore[arg-type]
        iter([("a", 1), ("b", 2)]),
        "3",
        broadcaster=Broadcaster(),  # type: ignore[arg-type]
    )
    assert out == {"success": True, "version": "3", "n": 2}
    with pytest.raises(ValueError, match="WeightBroadcaster"):
        verl_weights.push_weights(FakeClient(), [], "3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_path"):
        verl_weights.push_weights(FakeClient(), [], "3", mode="disk")  # type: ignore[arg-type]


def test_without_verl_the_engine_names_what_to_install() -> None:
    if importlib.util.find_spec("verl") is not None:
        pytest.skip("verl is installed here")
    with pytest.raises(MissingFramework, match="pip install verl==0.9.1"):
        verl_weights.AprilCheckpointEngine  # noqa: B018
