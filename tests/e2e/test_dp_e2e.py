"""Data parallelism inside one server (#13): `april-server --dp-size 2` on this CPU.

One rollout manager over two SGLang scheduler replicas: the quota stays exact, segments
spread over both ranks and record where they ran, each KV snapshot lives on its rank, and a
resume is pinned there and restores it (no re-prefill, the uninterrupted greedy output).
The server is started without SGLANG_CPU_OMP_THREADS_BIND: april-server sets it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.test_rollouts_e2e import (
    R,
    clear_buffer,
    group,
    interrupted_on_the_second_slot,
    ok,
    reference,
)
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
KV_BYTES = 256 * 1024**2  # the whole server's snapshot budget
PAGE = 1  # the CPU default page size


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ  # april-server must set it
    state: Path = tmp_path_factory.mktemp("april-dp")
    proc = ServerProc(state, ["--dp-size", "2", "--april-kv-host-bytes", str(KV_BYTES)])
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture()
def http(dp_server: ServerProc) -> Iterator[httpx.Client]:
    with dp_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def stats(http: httpx.Client) -> Any:
    return ok(http.get(R + "/stats"))


def by_rank(st: Any) -> dict[int, Any]:
    return {r["dp_rank"]: r for r in st["dp_ranks"]}


def test_stats_show_both_ranks_and_split_the_budget(http: httpx.Client) -> None:
    st = stats(http)
    assert st["dp_size"] == 2 and sorted(by_rank(st)) == [0, 1]
    assert st["snapshot_bytes_budget"] == KV_BYTES  # the server's budget ...
    for r in by_rank(st).values():
        assert r["snapshot_bytes_budget"] == KV_BYTES // 2  # ... split between the ranks
    assert st["max_total_tokens"] == sum(r["max_total_tokens"] for r in st["dp_ranks"])
    assert [(x["dp_rank"], x["engine"]) for x in st["running_by_slot"]] == [
        (0, "local"),
        (1, "local"),
    ]
    text = http.get("/metrics").text
    for rank in (0, 1):
        assert f'april_snapshot_bytes_used_by_rank{{dp_rank="{rank}"}}' in text
        assert f'april_running_samples_by_slot{{dp_rank="{rank}",engine="local"}}' in text


def test_quota_is_exact_and_resumes_land_on_their_snapshots_rank(http: httpx.Client) -> None:
    # 8 samples at once over two idle ranks: they alternate, so both long groups have a
    # sample on each rank. The short groups meet the quota; the long ones are interrupted
    # with snapshots (on_quota: snapshot, the default). The longs must outlast the shorts on
    # the other rank whatever the load (120 tokens did not, in the fleet's twin of this test).
    longs = [group(f"l{i}", [20 + i, 7], [600, 700], ignore_eos=True) for i in range(2)]
    shorts = [group(f"s{i}", [5 + i, 9], [6, 6]) for i in range(2)]
    body = {"groups": longs + shorts, "target_groups": 2, "max_inflight_groups": 4}
    r = ok(http.post(R + "/rollouts", json=body))
    assert sorted(g["group_id"] for g in r["groups"]) == ["s0", "s1"]  # exactly the quota
    assert sorted(r["buffered_group_ids"]) == ["l0", "l1"]
    first_ranks = {s["segments"][0]["dp_rank"] for g in r["groups"] for s in g["samples"]}
    assert first_ranks <= {0, 1}
    held = {
        s["sample_id"]: s
        for gid in ("l0", "l1")
        for s in ok(http.get(f"{R}/partials/{gid}"))["samples"]
    }
    # A snapshot lives where its segment ran (the server's record, not the sample's).
    ranks = {sid: s["segments"][-1]["dp_rank"] for sid, s in held.items()}
    assert set(ranks.values()) == {0, 1}, ranks  # spread over both ranks
    for s in held.values():
        assert s["status"] == "partial" and s["snapshot_bytes"] > 0
        assert s["segments"][-1]["engine"] == "local"
    st = stats(http)
    for rank, figures in by_rank(st).items():
        assert figures["snapshots"] == sum(1 for v in ranks.values() if v == rank)
    # Only the snapshots can now avoid the re-prefill.
    assert http.post("/flush_cache").status_code == 200
    out = ok(http.post(R + "/resume", json={"sample_ids": sorted(held), "kv": "restore"}))
    for s in out["samples"]:
        seg = s["segments"][-1]
        context = 2 + seg["start"]
        assert (seg["kv"], seg["dp_rank"]) == ("restored", ranks[s["sample_id"]]), seg
        assert seg["cached_tokens"] >= context - PAGE, (seg, context)
        assert s["status"] == "truncated" and len(s["output_ids"]) == s["max_new_tokens"]
    end = stats(http)
    assert end["restore_locks"] == 0 and end["snapshots"] == 0  # all released and freed
    assert all(r["restore_locks"] == 0 for r in end["dp_ranks"])


def test_resume_on_the_second_rank_equals_the_uninterrupted_run(http: httpx.Client) -> None:
    prompt, budget = [11, 42, 7], 150
    want, _ = reference(http, prompt, budget)
    # The trigger starts first and takes rank 0; the long sample runs on rank 1.
    s = interrupted_on_the_second_slot(http, prompt, budget)
    assert s["segments"][-1]["dp_rank"] == 1 and s["snapshot_bytes"] > 0
    assert by_rank(stats(http))[1]["snapshots"] == 1
    assert http.post("/flush_cache").status_code == 200
    # Rank 0 is idle, the least loaded: only affinity sends the resume to rank 1.
    out = ok(http.post(R + "/resume", json={"sample_ids": ["x/0"], "kv": "auto"}))
    s = out["samples"][0]
    seg = s["segments"][-1]
    assert (seg["kv"], seg["dp_rank"], seg["engine"]) == ("restored", 1, "local")
    assert seg["cached_tokens"] >= len(prompt) + seg["start"] - PAGE
    assert s["output_ids"] == want  # a restore reuses the original bits


def test_weight_update_and_abort_reach_both_ranks(
    http: httpx.Client, dp_server: ServerProc
) -> None:
    from april_server.models import ensure_tiny_model

    body = {"model_path": str(ensure_tiny_model()), "weight_version": "dp-v2"}
    assert ok(http.post("/update_weights_from_disk", json=body))["success"]
    # Long samples on both ranks (they alternate), stopped by one abort while they run. As
    # long as the model allows: /stats polled on a starved machine must see them running.
    groups = [group("a", [4, 2], [8000, 8000])]
    ok(
        http.post(
            R + "/rollouts",
            json={"groups": groups + [group("a-t", [1], [2])], "max_inflight_groups": 2},
        )
    )
    result: dict[str, Any] = {}

    def resume() -> None:
        with dp_server.client() as c:
            result["r"] = c.post(R + "/resume", json={"sample_ids": ["a/0", "a/1"]})

    t = threading.Thread(target=resume)
    t.start()
    while stats(http)["running_samples"] < 2 and t.is_alive():
        time.sleep(0.05)
    assert t.is_alive(), result["r"].text  # both were still generating
    ok(http.post(R + "/abort", json={"all": True, "keep": "tokens"}))
    t.join(timeout=300)
    samples = ok(result["r"])["samples"]
    assert all(s["status"] == "partial" for s in samples)  # the abort stopped both ranks
    segs = [s["segments"][-1] for s in samples]
    assert sorted(x["dp_rank"] for x in segs) == [0, 1]
    assert {x["weight_version"] for x in segs} == {"dp-v2"}  # both ranks run the new weights
    assert stats(http)["running_samples"] == 0
