"""Steps 7-10 of a call, where it ends and the background begins: stop what still generates
(with a snapshot for `snapshot` and `continue`), answer exactly `target_groups` finished groups,
buffer the rest, persist before answering, and hand a `continue` call's stragglers to the
background (`background.py`). Where no other call or operation holds the background, those
still generating pass to it in place and never stop (`Background.adopt`); otherwise they stop
with a snapshot and the background restores them once no call runs."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec

from april_client.protocol import Keep, RolloutResp, RolloutStats
from april_server.calls.parts import Generation, Holdings
from april_server.calls.state import CallState
from april_server.calls.turns_in_call import TurnsInCall
from april_server.engine.segment_state import Running
from april_server.rules import samples as sample_rules
from april_server.rules.idempotency import attempt_record
from april_server.runtime.background import Background
from april_server.runtime.pool_sizing import PoolSizing

_enc = msgspec.json.Encoder()
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class WindDown:
    state: CallState
    turns: TurnsInCall
    holdings: Holdings  # the call's groups, and the commit before the answer
    generation: Generation  # stops its segments; the version and counters of the answer
    background: Background  # takes a `continue` call's stragglers
    sizing: PoolSizing  # the advice for the next call's pool

    async def wind_down(self, t0: float, time_to_quota: float | None, deliver: bool) -> RolloutResp:
        state = self.state
        state.stopped = True
        # Step 7: nothing of this call may keep generating.
        runs = self.generation.segments.runs_of(state.batch_id)
        # `continue`: the stragglers the background can take as they are keep generating
        # (handed over in `_finish`); the rest stop with a snapshot, which it restores.
        going = self._going_on_in_place(runs)
        runs = [r for r in runs if r.sample.group_id not in going]
        for r in (r for rs in going.values() for r in rs):
            # Counted as the background's from here (what it generates between calls): their
            # segments end after this call's figures are read, or while it commits, and counted
            # on this call's tally then they would be in neither figure.
            r.tally = self.background.tally
        keep: Keep | None = "snapshot" if state.req.on_quota in ("snapshot", "continue") else None
        await self.generation.segments.stop(runs, keep)
        # A segment leaves `running` when its request returned but still records its end
        # (tokens, the snapshot taken) a few awaits later: persisting before that would store
        # the group without it and lose track of the snapshot.
        kept = {r.task for rs in going.values() for r in rs}
        await _recorded([t for t in state.tasks if t not in kept])
        # Agent rollouts: which members it interrupted (mid-turn or at a turn's start), and
        # which reached a turn stop as they were stopped.
        self.turns.say_interrupted(runs)
        for gid in dict.fromkeys(r.sample.group_id for r in runs):
            if gid in self.holdings.buffer.claimed:
                self.turns.announce_awaiting(gid)
        try:
            resp = await self._finish(time.perf_counter() - t0, time_to_quota, deliver)
        except Exception:
            # Nothing was made durable (the store failed): the groups go back to the buffer as
            # last persisted, so those meant to go on in place stop first, like the rest at
            # step 7; left generating, they would record into bodies nobody holds any more.
            going_runs = [r for rs in going.values() for r in rs]
            await self.generation.segments.stop(
                [r for r in going_runs if not r.stopping], "snapshot"
            )
            await _recorded([r.task for r in going_runs])
            raise
        if going:
            try:
                await self._hand_over_in_place(going)
            except Exception:  # the answer is durable already: it must still reach the caller
                logger.exception(
                    "april: rollout %s: persisting the stragglers it stopped failed; they go "
                    "back to the buffer as persisted with its answer",
                    state.batch_id,
                )
        for g in state.discarded:  # their KV snapshots go with them
            for sample in g.samples:
                await self.generation.segments.forget(sample)
        return resp

    def _going_on_in_place(self, runs: list[Running]) -> dict[str, list[Running]]:
        """The groups (and their runs) to hand to the background generating: a `continue`
        call's, where nothing but this call holds the background. Not a group being aborted,
        rejected, or of an agent episode (its turns are announced by the call that runs them)."""
        state = self.state
        if state.req.on_quota != "continue" or not self.background.may_adopt(state.batch_id):
            return {}
        by_group: dict[str, list[Running]] = {}
        for r in runs:
            by_group.setdefault(r.sample.group_id, []).append(r)
        return {
            gid: rs
            for gid, rs in by_group.items()
            if gid not in state.quota.rejected
            and gid not in state.given_up
            and not any(r.stopping or r.sample.turn_rule is not None for r in rs)
        }

    async def _hand_over_in_place(self, going: dict[str, list[Running]]) -> None:
        """After the answer was persisted: the background takes the groups still generating.
        Those it cannot take now (another call or operation came meanwhile, or a weight
        update) stop with a snapshot, as they would have at step 7, and are persisted again
        with what they generated since."""
        refused = self.background.adopt(self.state.batch_id, going)
        if not refused:
            return
        runs = [r for gid in refused for r in going[gid]]
        # Not one an abort is stopping meanwhile: that keeps what the abort asked for.
        await self.generation.segments.stop([r for r in runs if not r.stopping], "snapshot")
        await _recorded([r.task for r in runs])
        await self.holdings.persister.persist(
            [self.holdings.buffer.claimed[g] for g in refused], []
        )

    async def _finish(
        self, wall_s: float, time_to_quota: float | None, deliver: bool
    ) -> RolloutResp:
        """Steps 8-9: split groups, persist, build the response. With `deliver=False` (the
        caller is gone) nothing is returned and nothing dropped, so every group goes back to
        the buffer: `drop` and a rejection are the caller's decisions about a delivery, and a
        retry of the same `request_id` runs again on all the groups this attempt handed in."""
        state, req, claimed = self.state, self.state.req, self.holdings.buffer.claimed
        version = self.generation.versions.now()
        accepted = state.quota.accepted
        returned = accepted[: req.target_groups] if deliver else []
        rejected = sorted(state.quota.rejected) if deliver else []
        dropped = list(rejected)
        buffered = []
        for gid in state.group_ids:
            if gid in returned or gid in rejected:
                continue
            unfinished = not sample_rules.group_finished(claimed[gid])
            if deliver and req.on_quota == "drop" and unfinished and gid in state.started:
                dropped.append(gid)
            else:
                buffered.append(gid)
        groups = [claimed[g] for g in returned]
        held = [claimed[g] for g in state.group_ids]
        fresh = self.sizing.observe(req, held, groups if deliver else None, wall_s)
        choice = state.goodput
        notes = list(state.tally.notes)
        on_quota = req.on_quota
        if on_quota == "snapshot" and not self.generation.planner.snapshots_enabled:
            on_quota = "tokens"
            notes.append("on_quota=snapshot ran as tokens: this engine keeps no KV snapshots")
        stats = RolloutStats(
            wall_s=round(wall_s, 4),
            weight_version=version,
            num_finished_groups=len(returned),
            num_buffered_groups=len(buffered),
            output_tokens=state.tally.output_tokens,
            offpolicy_tokens=sum(sample_rules.offpolicy_tokens(g, version) for g in groups),
            resumed_samples=state.tally.resumed_samples,
            restored_kv_tokens=state.tally.restored_kv_tokens,
            recomputed_tokens=state.tally.recomputed_tokens,
            quota_met=len(returned) == req.target_groups,
            num_rejected_groups=len(rejected),
            num_dropped_groups=len(dropped) - len(rejected),
            time_to_quota_s=None if time_to_quota is None else round(time_to_quota, 4),
            on_quota_effective=on_quota,
            inflight_target=state.inflight_target,
            num_started_groups=len(state.started),
            peak_running_samples=state.peak_running,
            groups_wanted=(
                self.sizing.groups_wanted(
                    req,
                    [claimed[g] for g in state.group_ids],
                    [claimed[g] for g in buffered],
                    version,
                )
                if deliver
                else None
            ),
            offpolicy_fraction=round(
                sum(sample_rules.offpolicy_tokens(g, version) for g in groups)
                / max(1, sum(len(s.output_ids) for g in groups for s in g.samples)),
                4,
            ),
            notes=notes,
            extra_groups=state.extra_groups,
            goodput_expected_tok_s=None if choice is None else round(choice.expected.goodput, 3),
            goodput_sync_tok_s=None if choice is None else round(choice.sync.goodput, 3),
            goodput_tok_s=None if fresh is None or wall_s <= 0 else round(fresh / wall_s, 3),
        )
        resp = RolloutResp(
            batch_id=state.batch_id,
            groups=groups,
            buffered_group_ids=buffered,
            stats=stats,
            dropped_group_ids=dropped,
        )
        call = None
        if req.request_id is not None:
            # Delivered: the response, for retries. Not delivered (the caller went away, or a
            # bug): which sent groups this attempt handed in, so a retry runs again on them.
            body = _enc.encode(resp) if deliver else attempt_record(req)
            call = (req.request_id, body)
        # Dropped groups and returned ones leave the server: so do their KV snapshots.
        state.discarded = [claimed[g] for g in dropped + returned]
        await self.holdings.persister.persist(
            [claimed[g] for g in buffered], returned + dropped, call
        )
        self.background.forget(returned + dropped, gone=True)  # they left the server
        if req.on_quota == "continue":  # they go on generating once this call has ended
            # Not those an abort named meanwhile (it landed during the persist): it ended
            # their background life before it answered.
            going_on = [g for g in buffered if g in state.started and g not in state.given_up]
            self.background.add(
                [g for g in going_on if not sample_rules.group_finished(claimed[g])],
                req.max_staleness,
                state.batch_id,
            )
        self.generation.counters.returned_groups += len(returned)
        self.generation.counters.dropped_groups += len(dropped)
        return resp


async def _recorded(tasks: list[asyncio.Task[None]]) -> None:
    """Wait until these segment tasks have recorded their end (tokens, the snapshot taken)."""
    pending = [t for t in tasks if not t.done()]
    if pending:
        await asyncio.wait(pending)
