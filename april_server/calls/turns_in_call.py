"""Turns within one call (agent rollouts, docs/api.md "Turns"): a member whose turn ended at a
turn stop awaits input; a streamed call that declares `turns` says so on its stream
(`sample_awaiting`), waits for answers while it has nothing else to run, and continues an
answered member at once under its own quota (`continue_answered`, from
`POST /samples/{id}/input`). When the call winds down it says which generating members it
interrupted (`sample_interrupted`); awaiting members stay awaiting in the buffer. The rules of
a turn are `turns.py`'s."""

from __future__ import annotations

from april_client.protocol import Sample, SampleAwaitingEvent, SampleInterruptedEvent
from april_server.calls.state import CallState
from april_server.engine.segment_state import Running
from april_server.rules import samples as S
from april_server.rules import turns as T


class TurnsInCall(CallState):
    @property
    def takes_answers(self) -> bool:
        """Whether this call streams turn events and waits for answers: a streamed call that
        declares `turns` (for itself or a group it sends). Any other call runs what it can
        and never waits: its caller could not see who awaits (and an older client could not
        read the events)."""
        req = self.req
        return req.stream and (req.turns is not None or any(g.turns for g in req.groups))

    def _announce_awaiting(self, gid: str) -> None:
        """Emit `sample_awaiting` once per member and turn that now awaits input."""
        if not self.takes_answers:
            return
        for s in self.mgr.groups[gid].samples:
            if not T.awaiting(s):
                continue
            # A member reset since (dropped, restarted for staleness) reaches "the same" turn
            # again: the turn's end time tells them apart, or the call would wait for good for
            # an answer to a turn it never announced.
            key = (s.sample_id, len(s.turns), s.turns[-1].ended_at)
            if key in self.announced:
                continue
            self.announced.add(key)
            if self.events is not None:
                t = s.turns[-1]  # a turn is short: decoding it here costs little
                text = self.mgr.engine.detokenize(s.output_ids[t.start : t.end])
                event = SampleAwaitingEvent(
                    sample=s, turn=s.turn, batch_id=self.batch_id, text=text
                )
                self.events.put_nowait(event)

    def _waits_for_input(self) -> bool:
        """Whether the call has nothing generating but should wait for answers: it holds a
        member awaiting input, in a group nobody aborted during the call."""
        mgr = self.mgr
        if not self.takes_answers:
            return False
        for gid in self.group_ids:
            if gid in self.given_up or mgr.buffer.owner_of(gid) != self.batch_id:
                continue
            g = mgr.groups.get(gid)
            if g is not None and gid in self.started and any(T.awaiting(s) for s in g.samples):
                return True
        return False

    def holds_for_input(self, sample: Sample) -> bool:
        """Whether an answer for `sample` (of a group this call holds) continues it now."""
        return not self.stopped and sample.group_id not in self.given_up

    def continue_answered(self, sample: Sample) -> None:
        """Start the answered member's next turn now, under this call's quota."""
        gid = sample.group_id
        task = self.mgr.segments.start(sample, self.batch_id, self.tally, self.req.max_staleness)
        self.started.add(gid)
        self.tasks[task] = gid
        self.active[gid] = self.active.get(gid, 0) + 1
        self.peak_running = max(self.peak_running, len(self.tasks))
        self.wakeup.set()

    def give_up(self, group_ids: set[str] | None) -> None:
        """An abort named these groups (None: all of the call's): stop waiting for their
        answers; an answer that still arrives is recorded, and the member waits idle."""
        self.given_up.update(self.group_ids if group_ids is None else group_ids)
        self.wakeup.set()

    def _say_interrupted(self, runs: list[Running]) -> None:
        """After the wind-down stopped `runs`: one `sample_interrupted` per member of an agent
        episode left unfinished (mid_turn: it had generated part of its turn, kept). Calls
        without turns stream exactly what they did before."""
        if self.events is None or not self.takes_answers:
            return
        for r in runs:
            s = r.sample
            if s.turn_rule is None or S.is_finished(s) or T.awaiting(s):
                continue  # not an agent episode; or it ended (or reached a turn stop)
            event = SampleInterruptedEvent(
                sample_id=s.sample_id,
                turn=s.turn,
                mid_turn=T.tokens_in_turn(s) > 0,
                batch_id=self.batch_id,
            )
            self.events.put_nowait(event)
