"""kill -9 and restart on the same state dir: what was acknowledged survives, nothing is
duplicated, and a killed call is recoverable by retrying its request_id.

The tests share one server lifecycle (`crashing`): each kills and restarts it on its state dir,
and leaves it running with an empty buffer, so the next starts where it left (one start less
than a server per test; a test run alone starts it itself)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e import trainer_recompute
from tests.e2e.test_rollouts_e2e import R, group, ok
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e


# KV snapshots (their size and version) don't survive a crash
VOLATILE = {"snapshot_bytes", "snapshot_weight_version"}


def partials(c: httpx.Client) -> list[dict[str, Any]]:
    """The durable part of the buffer: everything but ages and KV snapshot figures."""
    return [
        {
            **g,
            "age_s": 0,
            "samples": [{k: v for k, v in s.items() if k not in VOLATILE} for s in g["samples"]],
        }
        for g in ok(c.get(R + "/partials"))["groups"]
    ]


def kill_while(srv: ServerProc, call: Any) -> None:
    """Start `call` in a thread and kill -9 the server while it is generating.

    The kill must land mid-generation: a call that ended first has acknowledged what it made,
    and the test's premise is gone. So its work is long (thousands of tokens) and its still
    running is checked just before the kill, failing as that rather than as a changed buffer."""
    t = threading.Thread(target=call, daemon=True)
    t.start()
    with srv.client() as c:
        deadline = time.monotonic() + 60
        while ok(c.get(R + "/stats"))["running_samples"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert ok(c.get(R + "/stats"))["running_samples"] > 0, "it ended before the kill"
    srv.kill9()
    t.join(30)


def swallow(c: httpx.Client, method: str, path: str, body: Any) -> None:
    try:
        c.request(method, path, json=body)
    except httpx.HTTPError:
        pass  # the server died under it, as intended


@pytest.fixture(scope="module")
def crashing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    srv = ServerProc(state_dir=tmp_path_factory.mktemp("april-crash"))
    try:
        yield srv
    finally:
        srv.stop()


def running(srv: ServerProc) -> ServerProc:
    """The shared server, started if no test left it running, with nothing buffered."""
    if srv.proc is None or srv.proc.poll() is not None:
        srv.start()
    with srv.client() as c:
        # A test that failed midway left its groups: clear them, so it fails alone
        for g in ok(c.get(R + "/partials"))["groups"]:
            c.delete(R + f"/partials/{g['group_id']}")
        assert partials(c) == []
    return srv


def test_crash_during_and_after_calls(crashing: ServerProc) -> None:
    srv = running(crashing)
    # 1. An acknowledged rollout leaves buffered groups.
    with srv.client() as c:
        groups = [group("done", [3], [4]), group("p", [8, 9], [4, 400]), group("q", [7], [3000])]
        body = {"groups": groups, "target_groups": 1, "max_inflight_groups": 3}
        r = ok(c.post(R + "/rollouts", json=body))
        assert sorted(r["buffered_group_ids"]) == ["p", "q"]
        before = partials(c)
    # 2. kill -9 during a rollout that claimed the buffered groups and sent new ones: after
    # the restart the buffer is as acknowledged in 1 (the acknowledged state survives a kill,
    # and the killed call changed none of it).
    body = {
        "groups": [group("new1", [5], [3000]), group("new2", [6], [3000])],
        "target_groups": 4,
        "request_id": "step-2",
    }
    kill_while(srv, lambda: swallow(srv.client(), "POST", R + "/rollouts", body))
    srv.start()
    with srv.client() as c:
        assert partials(c) == before  # nothing half-written; the killed call acked nothing
        # 3. kill -9 during a resume: the sample keeps its acknowledged state.
        kill_while(
            srv,
            lambda: swallow(srv.client(), "POST", R + "/resume", {"sample_ids": ["q/0"]}),
        )
    srv.start()
    with srv.client() as c:
        assert partials(c) == before
        # 4. Retrying the killed call's request_id runs it (once) to completion.
        small = {**body, "groups": [group("new1", [5], [30]), group("new2", [6], [30])]}
        r1 = ok(c.post(R + "/rollouts", json=small))
        r2 = ok(c.post(R + "/rollouts", json=small))
        assert r1 == r2  # idempotent: the second answer is the stored first one
        got = sorted(g["group_id"] for g in r1["groups"])
        assert got == ["new1", "new2", "p", "q"]
        lens = {g["group_id"]: [len(s["output_ids"]) for s in g["samples"]] for g in r1["groups"]}
        assert lens["p"] == [4, 400] and lens["q"] == [3000]
        assert partials(c) == []


def test_crash_during_background_generation_loses_no_acknowledged_token(
    crashing: ServerProc,
) -> None:
    """#19: kill -9 while stragglers of an answered call (`on_quota: continue`) and prefetched
    groups generate in the background; after a restart every acknowledged token is there."""
    srv = running(crashing)
    with srv.client() as c:
        body = {
            "groups": [group("fast", [3], [4]), group("slow", [8, 9], [8000])],
            "target_groups": 1,
            "on_quota": "continue",
        }
        r = ok(c.post(R + "/rollouts", json=body))
        assert r["buffered_group_ids"] == ["slow"]

        def background_running() -> None:
            deadline = time.monotonic() + 60
            while ok(c.get(R + "/stats"))["background_running_samples"] < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)

        # The straggler passed to the background generating: what its segment makes is
        # acknowledged when the segment ends. A call that takes nothing over pauses it.
        background_running()
        time.sleep(0.3)
        mid = {"groups": [group("mid", [4], [4])], "target_groups": 1, "resume_first": False}
        ok(c.post(R + "/rollouts", json=mid))
        acked = ok(c.get(R + "/partials/slow"))["samples"][0]["output_ids"]
        pre = ok(c.post(R + "/groups", json={"groups": [group("pre", [5], [8000])]}))
        assert pre["group_ids"] == ["pre"]
        background_running()
        time.sleep(0.5)
        assert ok(c.get(R + "/stats"))["background_running_samples"] >= 1  # killed mid-way
    srv.kill9()
    srv.start()
    with srv.client() as c:
        slow = ok(c.get(R + "/partials/slow"))
        assert slow["state"] == "idle"  # a restart treats them like any buffered group
        got = slow["samples"][0]["output_ids"]
        assert len(got) >= len(acked) > 0 and got[: len(acked)] == acked
        assert ok(c.get(R + "/partials/pre"))["samples"][0]["status"] == "partial"
        assert ok(c.get(R + "/stats"))["background_groups"] == 0
        for gid in ("slow", "pre"):  # leave the shared server's buffer empty
            ok(c.delete(R + f"/partials/{gid}"))
        assert partials(c) == []


def test_crash_keeps_the_sampling_mask_of_every_acknowledged_token(crashing: ServerProc) -> None:
    """kill -9 while masked stragglers generate in the background: after a restart each keeps
    at least its acknowledged tokens, every one with its row (the kept set a trainer
    recomputes: `trainer_recompute.py`), and its continuation extends them."""
    srv = running(crashing)
    sampled = {"temperature": 0.8, "top_k": 20, "top_p": 0.9}
    masked = [group("mg", [8, 9], [8000]), group("ms", [7, 9], [8000], **sampled)]
    with srv.client() as c:
        body = {
            "groups": [group("fast", [3], [4]), *masked],
            "target_groups": 1,
            "on_quota": "continue",
            "return_sampling_mask": True,
        }
        assert sorted(ok(c.post(R + "/rollouts", json=body))["buffered_group_ids"]) == ["mg", "ms"]
        deadline = time.monotonic() + 60
        while ok(c.get(R + "/stats"))["background_running_samples"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)
        mid = {"groups": [group("mid", [4], [4])], "target_groups": 1, "resume_first": False}
        ok(c.post(R + "/rollouts", json=mid))  # pauses them: what they made is acknowledged
        acked = {g: ok(c.get(f"{R}/partials/{g}"))["samples"][0] for g in ("mg", "ms")}
        time.sleep(0.5)  # generating again in the background
        assert ok(c.get(R + "/stats"))["background_running_samples"] == 2  # killed mid-way
    srv.kill9()
    srv.start()
    with srv.client() as c:
        restarted = {}
        for gid, before in acked.items():
            s = restarted[gid] = ok(c.get(f"{R}/partials/{gid}"))["samples"][0]
            n = len(before["output_ids"])
            assert n > 0 and s["output_ids"][:n] == before["output_ids"]
            rows = trainer_recompute.rows(s["sampling_mask"])
            assert len(rows) == len(s["output_ids"])
            assert rows[:n] == trainer_recompute.rows(before["sampling_mask"])
            assert s["sampling_mask"]["logprobs"][:n] == before["sampling_mask"]["logprobs"]
        # Their continuation after the restart (they start first) extends the rows.
        body = {"groups": [group("t", [5], [6])], "target_groups": 1, "on_quota": "tokens"}
        body["max_inflight_groups"] = 3
        assert ok(c.post(R + "/rollouts", json=body))["groups"][0]["group_id"] == "t"
        for gid in ("mg", "ms"):
            s = ok(c.get(f"{R}/partials/{gid}"))["samples"][0]
            rows = trainer_recompute.rows(s["sampling_mask"])
            if gid == "mg":
                assert rows == [[t] for t in s["output_ids"]]
            else:
                trainer_recompute.check_kept_sets(s, 0.8, 20, 0.9)
                assert trainer_recompute.recompute_gap(s, 0.8) < 1e-3
            assert len(rows) == len(s["output_ids"]) > len(restarted[gid]["output_ids"])
            ok(c.delete(f"{R}/partials/{gid}"))
        assert partials(c) == []
