"""The partial buffer that scales to a million samples: the index (`buffer_index.py`), the store
and its thread (`store.py`, `db_thread.py`), migration, paging, ids, bounded admission beside a
big buffer. Fake engine, real SQLite."""

from __future__ import annotations

import asyncio
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI
from hypothesis import given, settings
from hypothesis import strategies as st

from april_client.protocol import AbortReq, GroupSpec, RolloutReq
from april_server.buffer import store as store_mod
from april_server.buffer.buffer_index import BufferIndex, PartialsFilter, summarize
from april_server.buffer.store import BufferStore
from april_server.buffer.synthetic import fill, synthetic_group
from april_server.http.app import create_router
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.inflight import EngineCapacity
from tests.unit.fake_engine import FakeEngine, SnapshotFakeEngine
from tests.unit.idle import idle_bodies

R = "/april/v1"
NO_EOS = {"ignore_eos": True}


def entry(gid: str, seq: int, unfinished: int = 1, version: str = "0", age: float = 0.0) -> Any:
    g = synthetic_group(gid, random.Random(seq), n=2, output_len=2, created_at=time.time() - age)
    e = summarize(g, seq)
    e.unfinished, e.versions = unfinished, (version,)
    return e


# ---- index -------------------------------------------------------------------------------------


def test_index_keeps_age_order_and_counts_without_scanning() -> None:
    idx = BufferIndex([entry("c", 3), entry("a", 1), entry("b", 2, unfinished=0)])
    assert [e.group_id for e in idx.oldest()] == ["a", "b", "c"]
    assert (len(idx), idx.samples, idx.unfinished_groups, idx.unfinished_samples) == (3, 6, 2, 2)
    for gid in ("a", "b"):  # claimed, oldest first
        idx.remove(gid)
    idx.add(entry("a", 1))  # a released group goes back to its old position
    assert [e.group_id for e in idx.oldest()] == ["a", "c"]
    assert idx.remove("zz") is None and len(idx) == 2 and idx.samples == 4
    with pytest.raises(ValueError):
        idx.add(entry("d", 3))  # two groups can never share a position


def test_pages_never_skip_or_repeat_a_group_that_stayed() -> None:
    idx = BufferIndex([entry(f"g{i}", i) for i in range(1, 11)])
    seen: list[str] = []
    start: int | None = 0
    added = 100
    while start is not None:
        page, start = idx.page(start, 3, PartialsFilter(), time.time())
        seen += [e.group_id for e in page]
        idx.remove("g5")  # removed and added between pages
        idx.add(entry(f"new{added}", added))
        added += 1
    stayed = [f"g{i}" for i in range(1, 11) if i != 5]
    assert [g for g in seen if g in stayed] == stayed
    assert len(seen) == len(set(seen))


def test_page_filters_and_bounded_scans() -> None:
    idx = BufferIndex(
        [
            entry("old-v0", 1, age=100),
            entry("fin", 2, unfinished=0),
            entry("new-v1", 3, version="1"),
        ]
    )
    now = time.time()

    def ids(where: PartialsFilter) -> list[str]:
        return [e.group_id for e in idx.page(0, 10, where, now)[0]]

    assert ids(PartialsFilter(status="finished")) == ["fin"]
    assert ids(PartialsFilter(status="partial")) == ["old-v0", "new-v1"]
    assert ids(PartialsFilter(min_age_s=50)) == ["old-v0"]
    assert ids(PartialsFilter(weight_version="1")) == ["new-v1"]
    # A selective filter stops after max_scan groups and says where to go on.
    page, nxt = idx.page(0, 10, PartialsFilter(weight_version="1"), now, max_scan=2)
    assert page == [] and nxt == 3
    assert [e.group_id for e in idx.page(nxt, 10, PartialsFilter(weight_version="1"), now)[0]] == [
        "new-v1"
    ]


# ---- store -------------------------------------------------------------------------------------


def test_store_work_runs_off_the_calling_thread_in_submission_order(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    seen: list[str] = []
    first = st._db.submit(lambda db: seen.append(threading.current_thread().name), write=True)
    g = synthetic_group("x", random.Random(0))

    async def go() -> None:
        # A commit then a read, submitted back to back: the read sees the commit.
        commit = asyncio.ensure_future(st.commit([(g, 1)], []))
        await asyncio.sleep(0)
        got = await st.read_groups(["x"])
        await commit
        assert got["x"] == g

    asyncio.run(go())
    first.result()
    assert seen == ["april-store"]


def test_a_failing_commit_does_not_take_its_batch_with_it(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    gate = threading.Event()
    st._db.submit(lambda db: gate.wait(), write=False)  # hold the thread so commits queue up

    def boom(db: sqlite3.Connection) -> None:
        db.execute("INSERT INTO calls (request_id, seq, body) VALUES ('r', 1, x'00')")
        raise RuntimeError("boom")

    ok1 = st._db.submit(lambda db: db.execute("INSERT INTO calls VALUES ('a', 1, x'00')"), True)
    bad = st._db.submit(boom, True)
    ok2 = st._db.submit(lambda db: db.execute("INSERT INTO calls VALUES ('b', 2, x'00')"), True)
    gate.set()
    ok1.result(), ok2.result()
    with pytest.raises(RuntimeError):
        bad.result()
    rows = st._blocking(lambda db: db.execute("SELECT request_id FROM calls").fetchall())
    assert sorted(r[0] for r in rows) == ["a", "b"]  # the failed one left nothing behind


def test_statements_use_indexes_not_scans(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")

    def plan(sql: str, *args: Any) -> str:
        rows = st._blocking(lambda db: db.execute("EXPLAIN QUERY PLAN " + sql, args).fetchall())
        return " | ".join(r[-1] for r in rows)

    assert "COVERING INDEX buffer_summary_by_seq" in plan(
        f"SELECT {store_mod._SUMMARY} FROM buffer ORDER BY seq"
    )
    assert "INDEX" in plan("SELECT body FROM buffer WHERE group_id IN (?, ?)", "a", "b")
    assert "INDEX calls_by_seq" in plan("DELETE FROM calls WHERE seq <= ?", 5)
    assert "INDEX" in plan("SELECT body FROM calls WHERE request_id = ?", "r")


def test_version_1_state_dirs_load_and_their_odd_ids_stay_reachable(tmp_path: Path) -> None:
    path = tmp_path / "buffer.sqlite"
    legacy = synthetic_group("run/7 q", random.Random(1), n=2, vocab=64)  # "/" and a space
    plain = synthetic_group("plain", random.Random(2), n=1, vocab=64)
    db = sqlite3.connect(path)
    db.executescript(
        "CREATE TABLE groups (group_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body BLOB);"
        "CREATE TABLE calls (request_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body BLOB);"
    )
    for seq, g in [(2, plain), (1, legacy)]:
        db.execute("INSERT INTO groups VALUES (?, ?, ?)", (g.group_id, seq, msgspec.json.encode(g)))
    db.commit()
    db.close()

    mgr = RolloutManager(FakeEngine(), Durable.open(path))
    assert [e.group_id for e in mgr.buffer.idle.oldest()] == ["run/7 q", "plain"]
    mgr.check_integrity()
    app = FastAPI()
    app.include_router(create_router(lambda: mgr))

    async def go() -> None:
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://t") as c:
            r = await c.get(R + "/partials/run%2F7%20q")
            assert r.status_code == 200 and r.json()["samples"][1]["sample_id"] == "run/7 q/1"
            listed = (await c.get(R + "/partials")).json()["groups"]
            assert [g["group_id"] for g in listed] == ["run/7 q", "plain"]
            # Resumable by sample id, and served by a call's resume_first (oldest first).
            out = await mgr.resume(msgspec.convert({"sample_ids": ["run/7 q/0"]}, _resume_t()))
            assert out[0].status == "truncated"
            r = await c.delete(R + "/partials/run%2F7%20q")
            assert r.json() == {"group_id": "run/7 q", "deleted": True}

    asyncio.run(go())
    mgr.check_integrity()


def _resume_t() -> Any:
    from april_client.protocol import ResumeReq

    return ResumeReq


# ---- identifiers -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {"groups": [{"group_id": "a/b", "input_ids": [1]}]},
        {"groups": [{"group_id": "a b", "input_ids": [1]}]},
        {"groups": [{"group_id": "", "input_ids": [1]}]},
        {"groups": [{"group_id": "x" * 129, "input_ids": [1]}]},
        {"groups": [{"group_id": "é", "input_ids": [1]}]},
        {"groups": [{"group_id": "ok", "input_ids": [1]}], "request_id": "r\u0000"},
        {"groups": [{"group_id": "ok", "input_ids": [1]}], "request_id": "r/1"},
    ],
)
def test_ids_outside_the_contract_get_422_before_anything_starts(body: dict[str, Any]) -> None:
    mgr = RolloutManager(FakeEngine(), Durable.open(None))
    app = FastAPI()
    app.include_router(create_router(lambda: mgr))

    async def go() -> None:
        t = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=t, base_url="http://t") as c:
            r = await c.post(R + "/rollouts", json=body)
            assert r.status_code == 422, r.text
            assert r.json()["error"]["code"] == "invalid_id"

    asyncio.run(go())
    assert mgr.buffer.claimed == {} and not mgr.engine.calls  # type: ignore[attr-defined]


def test_ids_at_the_edge_of_the_contract_are_accepted() -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(), Durable.open(None))
        gid = "A-z_0.9:" + "x" * 120
        req = RolloutReq(
            groups=[GroupSpec(gid, input_ids=[1], sampling_params={"max_new_tokens": 1})],
            request_id="step:0017.a-b_c",
        )
        r = await mgr.rollout(req)
        assert len(gid) == 128 and r.groups[0].group_id == gid

    asyncio.run(go())


# ---- bounded admission beside a big buffer -----------------------------------------------------


class CapacityEngine(FakeEngine):
    """A fake engine that reports SGLang-like limits and remembers its peak concurrency."""

    def __init__(self, max_running: int, total_tokens: int) -> None:
        super().__init__(delay_s=0.002, vocab=256, context_len=512)
        self.cap = EngineCapacity(max_running, total_tokens)
        self.peak = 0

    async def capacity(self) -> EngineCapacity:
        return self.cap

    async def generate(self, rid: str, input_ids: list[int], params: dict[str, Any]) -> Any:
        self.peak = max(self.peak, len(self.active) + 1)
        return await super().generate(rid, input_ids, params)


@pytest.mark.parametrize("inflight", ["auto", 100_000])
def test_a_call_beside_a_big_buffer_claims_only_what_it_runs(
    tmp_path: Path, inflight: int | str
) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    fill(st, 5_000, n=4, prompt_len=16, output_len=8, budget=24)
    eng = CapacityEngine(max_running=16, total_tokens=100_000)
    mgr = RolloutManager(eng, Durable.load(st))
    assert len(mgr.buffer.idle) == 5_000

    async def go() -> None:
        seen_claimed = 0

        async def watch() -> None:
            nonlocal seen_claimed
            while True:
                seen_claimed = max(seen_claimed, len(mgr.buffer.claimed))
                await asyncio.sleep(0.001)

        w = asyncio.ensure_future(watch())
        new = [GroupSpec("new", n=4, input_ids=[5, 6])]
        req = RolloutReq(groups=new, max_inflight_groups=inflight)  # type: ignore[arg-type]
        r = await mgr.rollout(req)
        w.cancel()
        assert len(r.groups) == 1 and r.stats.quota_met
        # Admission: at most 16 running + a queue of 8 at once, never the buffer.
        assert eng.peak <= 16 + 8
        assert r.stats.num_started_groups <= 6 and seen_claimed <= 6 + 1  # + the sent one
        assert eng.peak >= (8 if inflight == "auto" else 16)
        # The oldest were served; the rest stayed idle (nothing it did not need was claimed).
        assert r.groups[0].group_id.startswith("syn-")
        assert len(mgr.buffer.idle) == 5_000 - 1 + 1  # one returned, the new one buffered

    asyncio.run(go())
    mgr.check_integrity()


# ---- a segment that ends during the wind-down --------------------------------------------------


def test_a_segment_still_recording_its_end_is_persisted_with_its_snapshot() -> None:
    async def go() -> None:
        # snapshot_info answers late: a segment lingers after its request returned
        eng = SnapshotFakeEngine(delay_s=0.005, info_delay_s=0.3)
        mgr = RolloutManager(eng, Durable.open(None))
        groups = [
            GroupSpec("long", input_ids=[1, 2], sampling_params={"max_new_tokens": 400, **NO_EOS}),
            GroupSpec("short", input_ids=[3, 4], sampling_params={"max_new_tokens": 40, **NO_EOS}),
        ]
        req = RolloutReq(groups=groups, on_quota="tokens", max_inflight_groups=2)
        call = asyncio.ensure_future(mgr.rollout(req))
        await asyncio.sleep(0.05)
        # "long" is stopped with a snapshot while "short" runs on and meets the quota during
        # the slow snapshot_info: the call winds down before "long" has recorded its end.
        stop = asyncio.ensure_future(mgr.abort(AbortReq(sample_ids=["long/0"], keep="snapshot")))
        r = await call
        await stop
        assert [g.group_id for g in r.groups] == ["short"]
        (stored,) = idle_bodies(mgr.buffer)
        assert stored.samples[0].snapshot_bytes == 100  # what the scheduler holds is known
        assert eng.snaps == {"long/0"}
        await mgr.delete("long")
        assert eng.snaps == set()  # ... so deleting the group frees it

    asyncio.run(go())


def test_the_loop_lag_monitor_sees_a_blocked_loop() -> None:
    from april_server.runtime.loop_lag import LoopLagMonitor

    async def go() -> dict[str, float]:
        mon = LoopLagMonitor()
        mon.start()
        await asyncio.sleep(0.05)
        time.sleep(0.15)  # blocks the loop, as O(buffer) work on it once did
        await asyncio.sleep(0.05)
        assert mon._task is not None
        mon._task.cancel()
        return mon.figures()

    figs = asyncio.run(go())
    assert figs["event_loop_lag_max_s"] >= 0.12
    assert figs["event_loop_lag_recent_max_s"] == figs["event_loop_lag_max_s"]


# ---- review of 2026-12-06: remembered responses are bounded in bytes ---------------------------


def test_remembered_responses_are_bounded_in_bytes_too(tmp_path: Path) -> None:
    """Found by review: the idempotency window was 10,000 responses whatever their size (each
    a whole response: every returned sample's tokens and logprobs), so a trainer naming every
    call kept ~10,000 steps of rollouts on disk. Now also at most `max_call_bytes`, the
    oldest forgotten first; the newest is always kept."""
    from april_server.buffer.store import CALLS_PRUNE_EVERY

    st = BufferStore(tmp_path / "b.sqlite")
    st.max_call_bytes = 10 * 1000

    async def go() -> None:
        for i in range(1, CALLS_PRUNE_EVERY + 1):
            await st.commit([], [], (f"step-{i}", bytes(1000)))
        kept = [i for i in range(1, CALLS_PRUNE_EVERY + 1) if await st.load_call(f"step-{i}")]
        assert kept == list(range(CALLS_PRUNE_EVERY - 9, CALLS_PRUNE_EVERY + 1))
        st.max_call_bytes = 10  # smaller than one response: the newest still stays
        for i in range(CALLS_PRUNE_EVERY + 1, 2 * CALLS_PRUNE_EVERY + 1):
            await st.commit([], [], (f"step-{i}", bytes(1000)))
        assert await st.load_call(f"step-{2 * CALLS_PRUNE_EVERY}") is not None
        assert await st.load_call(f"step-{2 * CALLS_PRUNE_EVERY - 1}") is None

    asyncio.run(go())
    st.close()


# ---- review of 2026-12-06: groups waiting only for answers are kept apart ------------------------


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["run", "wait", "done", "del"]))))
def test_the_index_keeps_waiting_groups_apart_and_lists_everything_by_age(
    ops: list[tuple[int, str]],
) -> None:
    """Found by review: a call claiming the oldest groups walked past every group that waits
    only for answers (abandoned agent episodes), on every refill: O(those) on the event loop.
    They now sit in their own map; listing, paging and popping still see every group by age."""
    idx, ref = BufferIndex(), {}  # ref: seq -> (group id, waits)
    for seq, op in ops:
        gid = f"g{seq}"
        if op == "del":
            idx.remove(gid)
            ref.pop(seq, None)
            continue
        e = entry(gid, seq, unfinished=0 if op == "done" else 1)
        e.awaiting = e.unfinished if op == "wait" else 0
        idx.add(e)  # a status change: the same group again
        ref[seq] = (gid, op == "wait")
    by_age = [ref[s][0] for s in sorted(ref)]
    assert [e.group_id for e in idx.oldest()] == by_age
    assert [e.group_id for e in idx.claimable_oldest()] == [
        ref[s][0] for s in sorted(ref) if not ref[s][1]
    ]
    assert idx.claimable == sum(not w for _, w in ref.values())
    paged, start = [], 0
    while start is not None:
        page, start = idx.page(start, 3, PartialsFilter(), time.time())
        paged += [e.group_id for e in page]
    assert paged == by_age
    for gid in by_age[:3]:
        idx.remove(gid)
    assert [e.group_id for e in idx.oldest()] == by_age[3:] and len(idx) == len(by_age[3:])
