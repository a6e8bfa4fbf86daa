"""RolloutManager, the composition root: it builds every part of the bookkeeping once, hands
each the parts it uses (typed, as constructor arguments), and offers the operations the routes
call (`rollout`, `abort`, ...; each an object from `calls/` or `operations/`). Besides wiring it
answers the two views that span every part: `/stats`, and `check_integrity()`.

Plain Python over asyncio: no torch, no SGLang (the engine is a `BaseEngine`). Invariants,
checked by `check_integrity()`:
- every known sample is in exactly one group, and a group is either idle in the buffer or
  held by exactly one owner: a call, the background or an operation (`partial_buffer.py`'s
  holder map; idle groups are summaries, bodies on disk);
- a sample is generating in at most one engine request (`running`), of a claimed group, for
  that group's holder;
- the buffer on disk equals the idle groups after every acknowledged call.
"""

from __future__ import annotations

from typing import Any

from april_server.calls.parts import CallParts, Generation, Holdings
from april_server.calls.rollout import Rollout
from april_server.engine.base import BaseEngine
from april_server.engine.clock import idle_shares
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Counters, Running
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.engine.versions import WeightVersions
from april_server.engine.weight_cut import WeightCut
from april_server.operations.abort import Abort
from april_server.operations.delete import Delete
from april_server.operations.forget_lengths import ForgetLengths
from april_server.operations.groups import AddGroups
from april_server.operations.inputs import PostInput
from april_server.operations.partials import Partials
from april_server.operations.resume import Resume
from april_server.root.durable import Durable
from april_server.rules import turns as turn_rules
from april_server.rules.goodput import LengthCensus
from april_server.rules.inflight import Admission
from april_server.rules.lengths import LengthModel
from april_server.runtime.background import OWNER as BACKGROUND
from april_server.runtime.background import Background
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.loop_lag import LoopLagMonitor
from april_server.runtime.persister import Persister
from april_server.runtime.pool_sizing import PoolSizing
from april_server.runtime.snapshot_sweep import SnapshotSweep
from april_server.settings.config import AprilConfig


class RolloutManager:
    def __init__(
        self,
        engine: BaseEngine,
        durable: Durable,
        config: AprilConfig | None = None,
        *,
        sweep_s: float = 0.0,
        watch_loop: bool = False,
    ) -> None:
        """`durable`: the store and what start-up loaded from it (`root/durable.py`);
        `sweep_s` > 0 starts a snapshot sweep at that interval (on the running loop) when the
        engine keeps snapshots; `watch_loop` starts the event-loop lag monitor (on the running
        loop: the server's, which every request shares)."""
        config = AprilConfig() if config is None else config
        # ---- the parts, each built from those before it ---------------------------------------
        self.engine = engine
        self.store = store = durable.store
        self.buffer = durable.buffer
        self.counters = Counters()
        self.admission = Admission()  # shared by every call: what the engine is given
        self.versions = WeightVersions(engine)
        self.lengths = LengthModel(
            durable.lengths, default_order=config.length_order, placement=config.placement
        )
        self.running: dict[str, Running] = {}  # sample id -> its engine request
        self.places = SnapshotPlaces()  # where each sample's KV snapshot lives
        self.planner = SegmentPlanner(
            engine, self.counters, self.admission, config.allow_stale_kv, self.lengths, self.places
        )
        # What a weight push cuts (`root/holder.py` hands it to the process's weight session).
        # The lengths the pool's goodput play draws from: seen at calls' ends and at cuts.
        census = LengthCensus()
        self.weight_cut = WeightCut(
            engine, self.running, self.versions, self.planner, self.places, census
        )
        self.segments = SegmentRunner(
            engine,
            self.counters,
            self.admission,
            self.versions,
            self.lengths,
            self.running,
            self.planner,
            self.weight_cut,
            self.places,
        )
        self.calls = LiveCalls()
        self.sizing = PoolSizing(engine, self.admission, self.lengths, self.versions, census)
        self.persister = Persister(self.buffer, store, self.running, self.lengths.history)
        self.background = Background(
            self.buffer,
            self.segments,
            self.planner,
            self.weight_cut,
            self.versions,
            self.admission,
            self.calls,
            self.places,
        )
        self.loop_lag: LoopLagMonitor | None = None
        if watch_loop:
            self.loop_lag = LoopLagMonitor()
            self.loop_lag.start()
        self.sweep: SnapshotSweep | None = None
        if sweep_s > 0 and self.planner.snap is not None:
            self.sweep = SnapshotSweep(
                self.planner.snap, self.running, self.buffer, self.places, sweep_s
            )
            self.sweep.start()

        # ---- the operations the routes call ---------------------------------------------------
        call_parts = CallParts(
            engine=engine,
            holdings=Holdings(self.buffer, self.persister),
            generation=Generation(self.segments, self.planner, self.versions, self.counters),
            sizing=self.sizing,
            lengths=self.lengths,
            background=self.background,
            calls=self.calls,
        )
        self.rollout = Rollout(store, self.calls, self.background, self.counters, call_parts)
        self.reject = self.calls.reject
        self.abort = Abort(self.calls, self.buffer, self.background, self.segments, self.counters)
        self.delete = Delete(self.buffer, self.background, self.segments, self.persister)
        self.resume = Resume(
            engine,
            self.buffer,
            self.background,
            self.segments,
            self.planner,
            self.versions,
            self.persister,
            self.counters,
        )
        self.post_input = PostInput(
            engine, self.calls, self.buffer, self.background, self.persister
        )
        self.add_groups = AddGroups(engine, store, self.buffer, self.background, self.persister)
        partials = Partials(self.buffer, self.segments, self.lengths)
        self.list_partials = partials.page
        self.show_partial = partials.one
        self.forget_lengths = ForgetLengths(self.lengths, store, self.sizing)
        self.weight_group = engine.weight_group

    async def close(self) -> None:
        """Stop the timers this root started (the snapshot sweep)."""
        if self.sweep is not None:
            await self.sweep.stop()

    # ---- the views over every part ------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant is broken. Valid at any moment between two
        callbacks (the simulator checks it there, `tests/sim`): the holder map is the one
        word on who holds a group, and every other view of it agrees with it."""
        buf, running, claimed = self.buffer, self.running, self.buffer.claimed
        for gid, g in claimed.items():
            assert all(s.group_id == gid for s in g.samples), gid
            assert [s.index for s in g.samples] == list(range(len(g.samples))), gid
            for s in g.samples:
                assert len(s.output_ids) == len(s.output_logprobs), s.sample_id
                assert len(s.output_ids) <= s.max_new_tokens, s.sample_id
                covered = sum(seg.end - seg.start for seg in s.segments)
                assert covered == len(s.output_ids), s.sample_id
        for sid, r in running.items():
            assert r.sample.sample_id == sid
            gid = r.sample.group_id
            assert gid in claimed, sid  # only claimed groups generate
            assert buf.owner_of(gid) == r.owner, (
                f"{sid} runs for {r.owner}, held by {buf.owner_of(gid)}"
            )
            assert claimed[gid].samples[r.sample.index] is r.sample, f"{sid}: another body"
        for batch_id, call in self.calls.items():
            held = buf.held_by(batch_id)
            listed = set(call.state.group_ids)
            assert held <= listed, f"{batch_id} holds {sorted(held - listed)} it does not list"
            if not call.state.stopped:  # a call that ended may have handed groups on (wind_down.py)
                assert listed == held, f"{batch_id} lists {sorted(listed - held)} it does not hold"
        self.background.check()
        buf.check(in_place=BACKGROUND)

    async def stats(self) -> dict[str, Any]:
        idle, claimed, running = self.buffer.idle, self.buffer.claimed, self.running
        c = self.counters
        kv: dict[str, Any] = {"kv_snapshots": "disabled"}
        clock = await self.engine.engine_clock()
        snap_engine = self.planner.snap
        if snap_engine is not None:
            kv = {"kv_snapshots": "enabled", **await snap_engine.snapshot_stats()}
            kv.update({} if self.sweep is None else self.sweep.stats())
        return {
            "weight_version": self.versions.now(),
            "buffered_groups": len(idle),
            "buffered_samples": idle.samples,
            "buffered_output_tokens": idle.output_tokens,
            "buffered_unfinished_groups": idle.unfinished_groups,
            "buffered_unfinished_samples": idle.unfinished_samples,
            "claimed_groups": len(claimed),
            # Agent rollouts: members whose turn ended at a turn stop, waiting for an answer
            # (idle ones from the index; those a call holds, from memory).
            "awaiting_input_samples": idle.awaiting_samples
            + sum(
                1
                for gid, g in claimed.items()
                if self.buffer.owner_of(gid) != BACKGROUND
                for s in g.samples
                if turn_rules.awaiting(s)
            ),
            **({} if self.loop_lag is None else self.loop_lag.figures()),
            "running_samples": len(running),
            "running_by_slot": self.planner.by_slot(),
            "active_calls": len(self.calls),
            "background_groups": len(self.background.wanted),
            "background_running_groups": len(self.background.running_groups()),
            "background_running_samples": sum(1 for r in running.values() if r.owner == BACKGROUND),
            "background_output_tokens": self.background.tally.output_tokens,
            "background_pauses": self.background.pauses,
            "background_pause_s": round(self.background.pause_s, 6),
            **kv,
            **{k: getattr(c, k) for k in c.__dataclass_fields__},
            "engine": self.engine.engine_stats(),
            "engine_time": clock,
            **idle_shares(clock),
            "inflight_policy": self.sizing.stats(),
            "length_prediction": self.lengths.figures(),
        }
