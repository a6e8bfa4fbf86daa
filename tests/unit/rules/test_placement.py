"""Placement (#13): where a segment runs is a pure decision; the engine performs it.

- `placement.plan_segment`: the snapshot's slot for a usable snapshot, else the least loaded
  healthy slot, and an unused snapshot is freed where it lives (properties, hypothesis);
- the segment runner over a fake engine with two DP ranks: fresh samples spread, a resume
  lands on its snapshot's rank and restores there, every KV act names the right rank;
- segments record their placement, durably (old rows load with the defaults);
- figures of several ranks: summed stats, the whole server's step curve.
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from april_client.protocol import AbortReq, GroupSpec, ResumeReq, RolloutReq
from april_server.buffer import store as store_mod
from april_server.buffer.store import BufferStore
from april_server.engine.base import SegmentCall, SnapshotEngine
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.inflight import StepCurve, StepStat, aggregate_curve, pool_steps
from april_server.rules.lengths import prompt_key
from april_server.rules.placement import (
    LOCAL,
    NoHealthySlot,
    SegmentPlan,
    Slot,
    SlotLoad,
    is_long,
    least_loaded,
    plan_segment,
)
from april_server.rules.ranks import merge_rank_stats
from april_server.rules.samples import SegmentResult
from tests.unit.fake_engine import FakeEngine
from tests.unit.idle import idle_bodies

ROOT = Path(__file__).resolve().parents[3]
NO_EOS = {"ignore_eos": True}

slots_st = st.builds(Slot, st.sampled_from(["local", "node-b"]), st.integers(0, 3))
loads_st = st.lists(
    st.builds(
        SlotLoad,
        slots_st,
        st.integers(0, 50),
        st.floats(0, 1e5, allow_nan=False),
        st.booleans(),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda x: x.slot,
)


# ---- the pure decision --------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(loads=loads_st, snapshot=st.none() | slots_st, use=st.booleans())
def test_plan_segment_properties(loads: list[SlotLoad], snapshot: Slot | None, use: bool) -> None:
    healthy = [x for x in loads if x.healthy]
    if not healthy:
        with pytest.raises(NoHealthySlot):
            plan_segment(loads, snapshot, use)
        return
    plan = plan_segment(loads, snapshot, use)
    assert plan.slot in {x.slot for x in healthy}  # never an unhealthy or unknown slot
    pinned = use and snapshot is not None and snapshot in {x.slot for x in healthy}
    if pinned:
        # Affinity: a usable snapshot is restored where it lives, whatever the load there.
        assert plan == SegmentPlan(snapshot, restore=True)  # type: ignore[arg-type]
    else:
        assert not plan.restore
        assert plan.drop == snapshot  # an unused snapshot is freed, where it lives
        best = min((x.running, x.kv_tokens) for x in healthy)
        chosen = next(x for x in healthy if x.slot == plan.slot)
        assert (chosen.running, chosen.kv_tokens) == best  # the least loaded


@given(st.integers(1, 6), st.integers(0, 40))
def test_fresh_segments_spread_evenly(n_slots: int, n_segments: int) -> None:
    counts = {Slot(LOCAL, r): 0 for r in range(n_slots)}
    for _ in range(n_segments):
        loads = [SlotLoad(s, c) for s, c in counts.items()]
        counts[plan_segment(loads, None, False).slot] += 1
    assert max(counts.values()) - min(counts.values()) <= 1


def test_ties_go_to_the_lowest_slot_and_unhealthy_ones_are_skipped() -> None:
    a, b = Slot(LOCAL, 0), Slot(LOCAL, 1)
    assert least_loaded([SlotLoad(b), SlotLoad(a)]) == a
    assert least_loaded([SlotLoad(a, healthy=False), SlotLoad(b, 9)]) == b
    # The snapshot's slot is down: run elsewhere and free what it held there.
    plan = plan_segment([SlotLoad(a, healthy=False), SlotLoad(b)], a, True)
    assert plan == SegmentPlan(b, restore=False, drop=a)


def test_the_decision_modules_do_no_io() -> None:
    """placement, snapshots and ranks decide; they import no engine and await nothing."""
    for name in ("placement.py", "snapshots.py", "ranks.py"):
        tree = ast.parse((ROOT / "april_server" / "rules" / name).read_text())
        mods = {
            (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import | ast.ImportFrom)
            for a in n.names
        }
        assert not {m.split(".")[0] for m in mods} & {"torch", "sglang", "asyncio"}, name
        assert "april_server.engine.base" not in mods, name
        assert not any(isinstance(n, ast.AsyncFunctionDef) for n in ast.walk(tree)), name


# ---- the runner over two DP ranks ---------------------------------------------------------------


class TwoRankEngine(FakeEngine, SnapshotEngine):
    """A fake engine with two DP ranks, each with its own snapshot store; every KV act is
    logged with the rank it names, so a test sees that only the right rank was asked."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.002, vocab=256)
        self.marks: dict[str, tuple[str, int]] = {}
        self.snaps: dict[int, dict[str, int]] = {0: {}, 1: {}}  # rank -> key -> tokens
        self.acts: list[tuple[str, str, int]] = []
        self.ran: dict[str, int] = {}  # rid -> rank

    def slots(self) -> list[Slot]:
        return [Slot(LOCAL, 0), Slot(LOCAL, 1)]

    async def generate_on(self, slot: Slot, call: SegmentCall) -> SegmentResult:
        self.ran[call.rid] = slot.dp_rank
        out = await self.generate(call.rid, call.input_ids, call.sampling_params)
        if out.finish_reason == "abort" and call.rid in self.marks:
            key, rank = self.marks[call.rid]
            assert rank == slot.dp_rank, "a mark must reach the rank running the request"
            self.snaps[rank][key] = len(call.input_ids) + len(out.output_ids) - 1
        return dataclasses.replace(out, dp_rank=slot.dp_rank)

    def send_mark(self, rid: str, key: str, slot: Slot) -> None:
        self.acts.append(("mark", key, slot.dp_rank))
        self.marks[rid] = (key, slot.dp_rank)

    async def restore_snapshot(self, key: str, slot: Slot, namespace: str | None = None) -> int:
        self.acts.append(("restore", key, slot.dp_rank))
        return self.snaps[slot.dp_rank].get(key, 0)

    async def release_snapshot(self, key: str, slot: Slot) -> None:
        self.acts.append(("unlock", key, slot.dp_rank))

    async def drop_snapshot(self, key: str, slot: Slot) -> None:
        self.acts.append(("drop", key, slot.dp_rank))
        self.snaps[slot.dp_rank].pop(key, None)

    async def snapshot_info(self, key: str, slot: Slot) -> dict[str, Any] | None:
        tokens = self.snaps[slot.dp_rank].get(key)
        return None if tokens is None else {"tokens": tokens, "bytes": 8 * tokens}

    async def snapshot_stats(self) -> dict[str, Any]:
        return {}


def test_a_resume_lands_on_its_snapshots_rank() -> None:
    async def go() -> None:
        eng = TwoRankEngine()
        mgr = RolloutManager(eng, Durable.open(None))
        params = {"max_new_tokens": 300, **NO_EOS}
        groups = [
            GroupSpec(f"g{i}", input_ids=[i + 1, 7], sampling_params=params) for i in range(4)
        ]
        trigger = GroupSpec("t", input_ids=[3], sampling_params={"max_new_tokens": 5, **NO_EOS})
        req = RolloutReq(groups=[trigger, *groups], on_quota="snapshot", max_inflight_groups=5)
        r = await mgr.rollout(req)
        assert [g.group_id for g in r.groups] == ["t"]
        # Five fresh samples over two idle ranks: spread, not piled on one.
        ranks = list(eng.ran.values())
        assert sorted(ranks.count(k) for k in (0, 1)) == [2, 3]
        held = {s.sample_id: s for g in idle_bodies(mgr.buffer) for s in g.samples}
        for sid, s in held.items():
            assert s.snapshot_bytes > 0
            rank = s.segments[-1].dp_rank
            assert mgr.places.of(s) == Slot(LOCAL, rank)
            assert ("mark", sid, rank) in eng.acts  # the mark named that rank only
            assert sid in eng.snaps[rank] and sid not in eng.snaps[1 - rank]
        # Resume one: it runs on its snapshot's rank, restores there, and frees it there.
        sid = "g2/0"
        place = mgr.places.of(held[sid])
        assert place is not None
        rank = place.dp_rank
        eng.acts.clear()
        (s,) = await mgr.resume(ResumeReq(sample_ids=[sid], kv="restore"))
        seg = s.segments[-1]
        assert (seg.kv, seg.engine, seg.dp_rank) == ("restored", LOCAL, rank)
        assert eng.acts == [("restore", sid, rank), ("unlock", sid, rank), ("drop", sid, rank)]
        assert s.status == "truncated" and s.snapshot_bytes == 0
        # kv: recompute never restores: the unused snapshot is freed where it lives first.
        other = "g0/0"
        other_place = mgr.places.of(held[other])
        assert other_place is not None
        other_rank = other_place.dp_rank
        eng.acts.clear()
        await mgr.resume(ResumeReq(sample_ids=[other], kv="recompute"))
        assert eng.acts[0] == ("drop", other, other_rank)
        assert not any(a[0] == "restore" for a in eng.acts)
        await mgr.abort(AbortReq(all=True))

    asyncio.run(go())


def test_an_idle_server_places_as_a_fresh_one_does() -> None:
    # KV needs are floats (context + 0.7 x budget): added and taken back in another order,
    # they used to leave a residue (~1e-14) on a rank with nothing running, which tipped
    # the next tie to the other rank (a flaky DP e2e test). Idle means exactly zero.
    async def go() -> None:
        eng = TwoRankEngine()
        mgr = RolloutManager(eng, Durable.open(None))
        groups = [
            GroupSpec(
                f"g{i}",
                input_ids=[i + 1] * (2 + i),
                sampling_params={"max_new_tokens": b, **NO_EOS},
            )
            for i, b in enumerate([120, 140, 6, 150, 8, 33])
        ]
        await mgr.rollout(RolloutReq(groups=groups, target_groups=2, max_inflight_groups=6))
        await mgr.abort(AbortReq(all=True))
        loads = mgr.segments.planner.loads()
        assert [(x.running, x.kv_tokens) for x in loads] == [(0, 0.0), (0, 0.0)]
        assert (mgr.admission.samples, mgr.admission.tokens) == (0, 0.0)
        eng.ran.clear()
        await mgr.rollout(
            RolloutReq(
                groups=[
                    GroupSpec("t", input_ids=[3], sampling_params={"max_new_tokens": 2, **NO_EOS})
                ],
                resume_first=False,
            )
        )
        assert list(eng.ran.values()) == [0]  # the tie goes to the lowest rank

    asyncio.run(go())


def test_stats_show_what_runs_where() -> None:
    async def go() -> dict[str, Any]:
        mgr = RolloutManager(TwoRankEngine(), Durable.open(None))
        return await mgr.stats()

    by_slot = asyncio.run(go())["running_by_slot"]
    assert [(x["engine"], x["dp_rank"], x["running_samples"]) for x in by_slot] == [
        (LOCAL, 0, 0),
        (LOCAL, 1, 0),
    ]


# ---- durable placement --------------------------------------------------------------------------


def test_placement_is_durable_and_old_rows_load_with_defaults(tmp_path: Path) -> None:
    async def go() -> None:
        eng = TwoRankEngine()
        st_ = BufferStore(tmp_path / "b.sqlite")
        mgr = RolloutManager(eng, Durable.load(st_))
        params = {"max_new_tokens": 200, **NO_EOS}
        groups = [GroupSpec(f"g{i}", input_ids=[i + 1], sampling_params=params) for i in range(2)]
        trigger = GroupSpec("t", input_ids=[3], sampling_params={"max_new_tokens": 4, **NO_EOS})
        await mgr.rollout(RolloutReq(groups=[trigger, *groups], max_inflight_groups=3))
        st_.close()

    asyncio.run(go())
    st2 = BufferStore(tmp_path / "b.sqlite")
    ranks = {s.segments[-1].dp_rank for g in st2.load_all() for s in g.samples}
    assert ranks == {0, 1}
    st2.close()
    # A body written before placement existed (no engine, no dp_rank, no snapshot slot).
    old = {
        "group_id": "old",
        "created_at": 1.0,
        "samples": [
            {
                "sample_id": "old/0",
                "group_id": "old",
                "index": 0,
                "status": "partial",
                "prompt_ids": [1],
                "output_ids": [2],
                "output_logprobs": [0.0],
                "segments": [{"start": 0, "end": 1, "weight_version": "0", "kv": "fresh"}],
                "max_new_tokens": 4,
                "finish_reason": None,
            }
        ],
    }
    for body in (msgspec.msgpack.encode(old), msgspec.json.encode(old)):
        g = store_mod.decode_group(body)
        seg = g.samples[0].segments[0]
        assert (seg.engine, seg.dp_rank) == (LOCAL, 0)


# ---- figures of several ranks -------------------------------------------------------------------


def test_rank_stats_sum_and_rates_average() -> None:
    ranks = [
        {"dp_rank": 0, "snapshots": 2, "snapshot_bytes_budget": 100, "save_gbps_mean": 2.0},
        {"dp_rank": 1, "snapshots": 1, "snapshot_bytes_budget": 100, "save_gbps_mean": 0.0},
    ]
    merged = merge_rank_stats(ranks)
    assert merged == {"snapshots": 3, "snapshot_bytes_budget": 200, "save_gbps_mean": 2.0}


def test_one_rank_curve_is_unchanged() -> None:
    curve = {1: StepStat(5, 0.01, 0.001, 20.0, 0.001, 40.0), 4: StepStat(5, 0.02, 0.001)}
    assert aggregate_curve([curve]) == curve
    assert aggregate_curve([]) == {}


@given(
    mean=st.floats(0.001, 1.0),
    std=st.floats(0.0, 0.01),
    steps=st.integers(2, 50),
    ranks=st.integers(2, 4),
)
def test_identical_ranks_scale_the_batch_not_the_step(
    mean: float, std: float, steps: int, ranks: int
) -> None:
    per_rank = {1: StepStat(steps, mean, std), 8: StepStat(steps, 2 * mean, std)}
    agg = aggregate_curve([per_rank] * ranks)
    assert sorted(agg) == [ranks, 8 * ranks]  # n x b samples server-wide ...
    assert agg[ranks].mean_s == pytest.approx(mean)  # ... step in one rank's time for b
    assert agg[ranks].steps == ranks * steps
    # So the whole server's throughput at n x b is n times one rank's at b (without spread:
    # pooled sizes are measured n times as often, so the policy credits them less doubt).
    exact = {b: m._replace(std_s=0.0) for b, m in per_rank.items()}
    one, many = StepCurve.smoothed(exact), StepCurve.smoothed(aggregate_curve([exact] * ranks))
    assert many.throughput(8 * ranks) == pytest.approx(ranks * one.throughput(8))


def test_pooling_keeps_the_context_slope() -> None:
    # Two ranks measured the same size at different contexts with the same cost per token.
    a = StepStat(10, 0.010, 0.0, 100.0, 10 * 0.0001 * 50.0**2 / 50.0, 10 * 50.0**2 / 50.0)
    b = StepStat(10, 0.020, 0.0, 200.0, a.s_tc, a.s_cc)
    m = pool_steps([a, b])
    assert m.steps == 20 and m.mean_s == pytest.approx(0.015)
    assert m.mean_context == pytest.approx(150.0)
    assert m.s_tc / m.s_cc == pytest.approx(0.0001, rel=1e-6)  # the between-rank part agrees


# ---- DP on a CPU: what april-server sets by itself ----------------------------------------------


def test_cpu_ranks_get_their_own_cores() -> None:
    from april_server.cli import cpu_bind, world_size

    assert cpu_bind([0, 1], 2) == "0|1"  # this machine, --dp-size 2
    assert cpu_bind(list(range(8)), 2) == "0-3|4-7"
    assert cpu_bind([0, 2, 4, 6], 2) == "0,2|4,6"
    assert cpu_bind([0], 2) == "0|0"  # fewer cores than ranks: they share
    assert world_size(["--dp-size", "2", "--tp-size=2"]) == 4
    assert world_size(["--port", "1"]) == 1


def test_the_dp_controller_waits_for_a_request_instead_of_spinning() -> None:
    import zmq

    from april_server.door.dp_hooks import POLL_MS, WaitingSocket

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://dpc")
        push.connect("inproc://dpc")
        sock = WaitingSocket(pull)
        with pytest.raises(zmq.Again):  # nothing came within the wait: the loop goes round
            sock.recv_pyobj(flags=zmq.NOBLOCK)
        push.send_pyobj({"op": "x"})
        assert sock.recv_pyobj(flags=zmq.NOBLOCK) == {"op": "x"}
        assert sock.closed is False and POLL_MS > 0  # everything else is the socket's
    finally:
        push.close(0)
        pull.close(0)
        ctx.term()


# ---- tail placement -----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    loads=loads_st,
    snapshot=st.none() | slots_st,
    use=st.booleans(),
    long=st.sampled_from([None, True, False]),
)
def test_tail_placement_properties(
    loads: list[SlotLoad], snapshot: Slot | None, use: bool, long: bool | None
) -> None:
    healthy = sorted((x for x in loads if x.healthy), key=lambda x: x.slot)
    if not healthy:
        with pytest.raises(NoHealthySlot):
            plan_segment(loads, snapshot, use, long)
        return
    plan = plan_segment(loads, snapshot, use, long)
    if use and snapshot is not None and snapshot in {x.slot for x in healthy}:
        assert plan == SegmentPlan(snapshot, restore=True)  # a snapshot still decides
        return
    if long is None or len(healthy) < 2:  # nothing to tell: by load alone
        assert plan == plan_segment(loads, snapshot, use)
        return
    tail, body = healthy[-1], healthy[:-1]
    preferred = tail if long else min(body, key=lambda x: (x.running, x.kv_tokens, x.slot))
    least = min(x.running for x in healthy)
    if preferred.running <= 2 * least + 2:  # long on the tail slot, short off it
        assert plan.slot == preferred.slot
    else:  # the balance bound: the least loaded instead
        assert plan.slot == least_loaded(healthy)


def test_long_means_longer_than_the_typical_finished_length() -> None:
    assert is_long(None, 50.0) is None  # no prediction
    assert is_long(80, 0.0) is None  # nothing finished yet
    assert is_long(80, 50.0) is True
    assert is_long(50, 50.0) is False


def test_tail_placement_puts_the_predicted_long_on_one_rank() -> None:
    """Through the manager: with history saying prompts 1-3 run long and 4-6 short, the long
    samples run on the tail slot (the higher rank) and the short ones on the other; without
    the flag, the same call spreads by load alone."""

    async def go(placement: str) -> dict[str, int]:
        eng = TwoRankEngine()
        mgr = RolloutManager(eng, Durable.open(None))
        mgr.segments.lengths.placement = placement  # type: ignore[assignment]
        lengths = mgr.segments.lengths
        for p in range(1, 7):
            for _ in range(4):
                length = 40 if p <= 3 else 4
                lengths.history.add(prompt_key([p, 9]), length)
                lengths.finished_count += 1
                lengths.finished_sum += length
        params = {"max_new_tokens": 60, **NO_EOS}
        groups = [GroupSpec(f"p{p}", input_ids=[p, 9], sampling_params=params) for p in range(1, 7)]
        await mgr.rollout(RolloutReq(groups=groups, max_inflight_groups=6))
        return {rid.split("@")[0]: rank for rid, rank in eng.ran.items()}

    tail = asyncio.run(go("tail"))
    assert {s: r for s, r in tail.items() if s < "p4"} == {"p1/0": 1, "p2/0": 1, "p3/0": 1}
    assert {s: r for s, r in tail.items() if s >= "p4"} == {"p4/0": 0, "p5/0": 0, "p6/0": 0}
    spread = asyncio.run(go("least_loaded"))
    assert sorted(spread.values()) == [0, 0, 0, 1, 1, 1]
    assert spread != tail  # by load alone, alternating: the long ones are not together
