"""Turns within one call (agent rollouts, docs/api.md "Turns"): a member whose turn ended at a
turn stop awaits input; a streamed call that declares `turns` says so on its stream
(`sample_awaiting`), waits for answers while it has nothing else to run, and continues an
answered member at once under its own quota (`continue_answered`, from
`POST /samples/{id}/input`). When the call winds down it says which generating members it
interrupted (`sample_interrupted`); awaiting members stay awaiting in the buffer. The rules of
a turn are `rules/turns.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

from april_client.protocol import Sample, SampleAwaitingEvent, SampleInterruptedEvent
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.calls.state import CallState
from april_server.engine.base import BaseEngine
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import Running
from april_server.rules import samples as sample_rules
from april_server.rules import turns as turn_rules


@dataclass(eq=False)
class TurnsInCall:
    state: CallState
    engine: BaseEngine  # to show an awaiting member's turn as text
    buffer: PartialBuffer
    segments: SegmentRunner

    @property
    def takes_answers(self) -> bool:
        """Whether this call streams turn events and waits for answers: a streamed call that
        declares `turns` (for itself or a group it sends). Any other call runs what it can
        and never waits: its caller could not see who awaits (and an older client could not
        read the events)."""
        req = self.state.req
        return req.stream and (req.turns is not None or any(g.turns for g in req.groups))

    def announce_awaiting(self, gid: str) -> None:
        """Emit `sample_awaiting` once per member and turn that now awaits input."""
        if not self.takes_answers:
            return
        state = self.state
        for s in self.buffer.claimed[gid].samples:
            if not turn_rules.awaiting(s):
                continue
            # A member reset since (dropped, restarted for staleness) reaches "the same" turn
            # again: the turn's end time tells them apart, or the call would wait for good for
            # an answer to a turn it never announced.
            key = (s.sample_id, len(s.turns), s.turns[-1].ended_at)
            if key in state.announced:
                continue
            state.announced.add(key)
            if state.events is not None:
                t = s.turns[-1]  # a turn is short: decoding it here costs little
                text = self.engine.detokenize(s.output_ids[t.start : t.end])
                state.emit(
                    SampleAwaitingEvent(sample=s, turn=s.turn, batch_id=state.batch_id, text=text)
                )

    def waits_for_input(self) -> bool:
        """Whether the call has nothing generating but should wait for answers: it holds a
        member awaiting input, in a group nobody aborted during the call."""
        if not self.takes_answers:
            return False
        state = self.state
        for gid in state.group_ids:
            if gid in state.given_up or self.buffer.owner_of(gid) != state.batch_id:
                continue
            g = self.buffer.claimed.get(gid)
            if (
                g is not None
                and gid in state.started
                and any(turn_rules.awaiting(s) for s in g.samples)
            ):
                return True
        return False

    def holds_for_input(self, sample: Sample) -> bool:
        """Whether an answer for `sample` (of a group this call holds) continues it now."""
        return not self.state.stopped and sample.group_id not in self.state.given_up

    def continue_answered(self, sample: Sample) -> None:
        """Start the answered member's next turn now, under this call's quota."""
        state, gid = self.state, sample.group_id
        task = self.segments.start(sample, state.batch_id, state.tally, state.req.max_staleness)
        state.started.add(gid)
        state.tasks[task] = gid
        state.active[gid] = state.active.get(gid, 0) + 1
        state.note_running()
        state.wakeup.set()

    def give_up(self, group_ids: set[str] | None) -> None:
        """An abort named these groups (None: all of the call's): stop waiting for their
        answers; an answer that still arrives is recorded, and the member waits idle."""
        state = self.state
        state.given_up.update(state.group_ids if group_ids is None else group_ids)
        state.wakeup.set()

    def say_interrupted(self, runs: list[Running]) -> None:
        """After the wind-down stopped `runs`: one `sample_interrupted` per member of an agent
        episode left unfinished (mid_turn: it had generated part of its turn, kept). Calls
        without turns stream exactly what they did before."""
        if self.state.events is None or not self.takes_answers:
            return
        for r in runs:
            s = r.sample
            if s.turn_rule is None or sample_rules.is_finished(s) or turn_rules.awaiting(s):
                continue  # not an agent episode; or it ended (or reached a turn stop)
            event = SampleInterruptedEvent(
                sample_id=s.sample_id,
                turn=s.turn,
                mid_turn=turn_rules.tokens_in_turn(s) > 0,
                batch_id=self.state.batch_id,
            )
            self.state.emit(event)
