"""A weight push from disk vs over the wire, on a real CPU april-server.

Not a test. For each model: a private server; this process is the trainer, holding the same
model. Each repeat times, alternating which goes first:
- `disk`: `save_pretrained` to a fresh directory + `POST /update_weights_from_disk` (what the
  TRL adapter did before; the trainer and the server share the filesystem);
- `wire`: `WeightBroadcaster.push` (begin, update_weights_from_distributed with the tensors
  broadcast over gloo, end; the group is built once, before the first timed push).
Both idle and while the server generates in the background (two long greedy samples), which a
push must not wait for. Medians (min-max) side by side, from one run:

    python -m april_bench.weights [--models tiny,smollm2] [--repeats 5] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from april_client import AprilClient
from april_client.weight_sync import WeightBroadcaster
from april_server.launcher import LaunchedServer

R = "/april/v1"


def load_model(name: str) -> Any:
    from transformers import AutoModelForCausalLM

    from april_server.models import ensure_smollm2, ensure_tiny_model

    path = ensure_tiny_model() if name == "tiny" else ensure_smollm2()
    return AutoModelForCausalLM.from_pretrained(path)


def background(c: httpx.Client, tag: str) -> None:
    """Two long greedy samples generating in the background (no call running)."""
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 3000}
    groups = [
        {"group_id": f"{tag}{i}", "input_ids": [40 + i, 9], "n": 1, "sampling_params": params}
        for i in range(2)
    ]
    c.post(R + "/groups", json={"groups": groups, "start": "background"}).raise_for_status()
    end = time.monotonic() + 120
    while c.get(R + "/stats").json()["background_running_samples"] < 2:
        if time.monotonic() > end:
            raise RuntimeError("background generation did not start")
        time.sleep(0.05)
    time.sleep(0.5)


def clear(c: httpx.Client) -> None:
    c.post(R + "/abort", json={"all": True, "keep": "drop"})
    for g in c.get(R + "/partials").json()["groups"]:
        c.delete(f"{R}/partials/{g['group_id']}")


def disk_push(client: AprilClient, model: Any, root: Path, version: str) -> float:
    t0 = time.perf_counter()
    path = root / version
    model.save_pretrained(path, safe_serialization=True)
    out = client.update_weights_from_disk(str(path), weight_version=version)
    took = time.perf_counter() - t0
    if not out.get("success"):
        raise RuntimeError(f"disk push failed: {out}")
    shutil.rmtree(path, ignore_errors=True)
    return took


def wire_push(sync: WeightBroadcaster, model: Any, version: str) -> float:
    t0 = time.perf_counter()
    out = sync.push(model.named_parameters(), version)
    took = time.perf_counter() - t0
    if not out.get("success"):
        raise RuntimeError(f"wire push failed: {out}")
    return took


def bench_model(name: str, repeats: int) -> dict[str, Any]:
    model = load_model(name)
    mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    extra = ["--april-model", name] if name != "tiny" else []
    times: dict[str, list[float]] = {k: [] for k in ("disk", "wire", "disk_bg", "wire_bg")}
    root = Path(tempfile.mkdtemp(prefix="april-bench-weights-"))
    with LaunchedServer(extra) as srv, httpx.Client(base_url=srv.url, timeout=600) as c:
        client = AprilClient(srv.url, timeout=600)
        sync = WeightBroadcaster(client)
        wire_push(sync, model, "warm")  # builds the group: not timed
        disk_push(client, model, root, "warm-disk")
        for i in range(repeats):
            order = ["disk", "wire"] if i % 2 == 0 else ["wire", "disk"]
            for busy in (False, True):
                for way in order:
                    if busy:
                        background(c, f"bg{i}{way}")
                    version = f"{way}-{i}-{int(busy)}"
                    took = (
                        disk_push(client, model, root, version)
                        if way == "disk"
                        else wire_push(sync, model, version)
                    )
                    times[way + ("_bg" if busy else "")].append(took)
                    if busy:
                        clear(c)
        sync.close()
        client.close()
    shutil.rmtree(root, ignore_errors=True)
    return {"model": name, "weights_mb": round(mb, 1), "repeats": repeats, "times_s": times}


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| model | weights | disk push | wire push | disk/wire | disk push, busy "
        "| wire push, busy |\n|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        t = r["times_s"]
        ratio = statistics.median(t["disk"]) / statistics.median(t["wire"])
        lines.append(
            f"| {r['model']} | {r['weights_mb']} MB | {fmt(t['disk'])} | {fmt(t['wire'])} "
            f"| {ratio:.1f}x | {fmt(t['disk_bg'])} | {fmt(t['wire_bg'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="april-bench-weights", description=__doc__)
    ap.add_argument("--models", default="tiny,smollm2")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args(argv)
    rows = []
    for name in args.models.split(","):
        print(f"weights bench: {name} ...", flush=True)
        rows.append(bench_model(name, args.repeats))
    print(f"seconds per push, median (min-max) of {args.repeats}; busy: two greedy samples")
    print("generating in the background while the push runs")
    print(table(rows))
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
