"""Weights over the wire (#34), on one real server: this test process is the trainer, rank 0 of
a gloo group with the server's scheduler (`april_client.weight_sync.WeightBroadcaster`), and
broadcasts changed weights while background generation runs.

- the server then generates exactly the greedy tokens of the same changed weights loaded by
  SGLang's own checkpoint loader (the weights saved and pushed from disk on the same server:
  the path a server started from them takes), and not those of the weights before;
- segments carry the pushed version from the push on; no token generated before it is lost or
  re-stamped (the background samples' earlier segments keep their version and tokens);
- the push never waits for the background samples (they are cut at the version boundary);
- a second push reuses the group; a server that lost it (here: told to leave it) gets a new one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from april_client import AprilClient
from april_client.weight_sync import WeightBroadcaster
from april_server.models import ensure_tiny_model
from tests.e2e.test_rollouts_e2e import R, clear_buffer, group, ok
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
PROMPT = [5, 6, 7, 8]


def changed_model(seed: int) -> Any:
    """The tiny model with every weight moved by seeded noise (what a training step does)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_model())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def greedy(c: httpx.Client, prompt: list[int] = PROMPT, n: int = 16) -> list[int]:
    params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
    out: list[int] = ok(c.post("/generate", json={"input_ids": prompt, "sampling_params": params}))[
        "output_ids"
    ]
    return out


def wait_running(c: httpx.Client, n: int) -> None:
    end = time.monotonic() + 120
    while ok(c.get(R + "/stats"))["background_running_samples"] < n:
        assert time.monotonic() < end, "background generation never started"
        time.sleep(0.05)


def test_a_broadcast_during_background_generation_is_exact_and_keeps_every_token(
    weights_server: ServerProc, tmp_path: Path
) -> None:
    srv = weights_server
    with srv.client() as c, AprilClient(srv.url, timeout=300) as client:
        clear_buffer(c)
        old = greedy(c)
        version_before = client.weight_group().weight_version
        # Built first: loading the model class can take seconds, and the push must land
        # while the samples below still generate (they are aborted, so long costs nothing).
        model = changed_model(seed=1)
        sync = WeightBroadcaster(client)
        # Background generation: two long samples, no call running.
        groups = [group(f"wire{i}", [40 + i, 9], [8000], ignore_eos=True) for i in range(2)]
        ok(c.post(R + "/groups", json={"groups": groups, "start": "background"}))
        wait_running(c, 2)
        time.sleep(0.5)
        t0 = time.perf_counter()
        out = sync.push(model.named_parameters(), "wire-1")
        took = time.perf_counter() - t0
        assert out["success"], out
        info = client.weight_group()
        assert info.group == sync.name and info.world_size == 2 and info.in_sync
        assert info.weight_version == "wire-1"
        # Every token generated before the push is kept with its version; the rest is new.
        time.sleep(1.0)
        ok(c.post(R + "/abort", json={"all": True, "keep": "tokens"}))
        for g in groups:
            (s,) = ok(c.get(f"{R}/partials/{g['group_id']}"))["samples"]
            versions = [x["weight_version"] for x in s["segments"]]
            assert versions[0] == version_before, versions
            assert "wire-1" in versions, versions  # continued under the new weights
            first_new = versions.index("wire-1")
            assert set(versions[:first_new]) == {version_before}
            assert set(versions[first_new:]) == {"wire-1"}
            assert len(s["output_ids"]) == sum(x["end"] - x["start"] for x in s["segments"])
        clear_buffer(c)
        # The pushed weights: the same greedy tokens as SGLang's loader gives from a checkpoint.
        wire = greedy(c)
        model.save_pretrained(tmp_path / "changed")
        assert client.update_weights_from_disk(str(tmp_path / "changed"), "disk-1")["success"]
        assert greedy(c) == wire
        assert wire != old, "the changed weights generate what the old ones did: untested"
        # A second push reuses the group; after the server left it, the next one builds another.
        t1 = time.perf_counter()
        assert sync.push(model.named_parameters(), "wire-2")["success"]
        again = time.perf_counter() - t1
        assert sync.rebuilt == 1
        first = sync.name
        client.destroy_weights_update_group(first)
        assert client.weight_group().group is None
        assert sync.push(model.named_parameters(), "wire-3")["success"]
        assert sync.rebuilt == 2 and sync.name != first and greedy(c) == wire
        sync.close()
        assert client.weight_group().group is None
        print(f"broadcast push during background generation {took:.3f} s, again {again:.3f} s")


def test_a_push_to_a_group_of_the_wrong_size_is_refused_clearly(weights_server: ServerProc) -> None:
    with AprilClient(weights_server.url, timeout=60) as client:
        with pytest.raises(ValueError, match="world_size"):
            client.init_weights_update_group("127.0.0.1", 1, 1, "x", "gloo")
        with pytest.raises(ValueError, match="names, dtypes and shapes"):
            client.update_weights_from_distributed(["a"], [], [[1]], "x")
