"""`POST /april/v1/samples/{sample_id}/input`: the tool's answer for a member awaiting input.

- A running call holds the member's group: the answer is appended and the member continues at
  once under that call's quota (`turns_in_call.continue_answered`); it is made durable with the
  call's outcome, like every token the call generates. An abort that named the group during
  the call keeps the answer but does not continue the member (it waits idle after the call);
  durable with that call's outcome all the same, the answer names the call.
- A call that is winding down holds it: the answer waits until the call has handed the group
  back, then is taken as below (never lost between the call's persist and its release).
- Otherwise (idle in the buffer, or held by the background, which is paused for it, after
  which the holder is looked up again: a call may have taken the group meanwhile): the
  group is claimed, the answer appended and persisted (fsync) before the route answers; the
  member waits idle for the next call.
Who holds the group is resolved by `PartialBuffer.resolve`, which waits out a claim whose body
is still being read: a sample just announced as awaiting is never 404 for a moment.
Answers for one group are taken one at a time, so a second answer for the same turn always
sees the first and gets 409 `not_awaiting`, changing nothing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass, field

from april_client.protocol import InputReq, InputResp, Sample
from april_server.buffer.buffer_index import BufferEntry
from april_server.buffer.partial_buffer import Holder, PartialBuffer
from april_server.engine.base import BaseEngine
from april_server.rules import samples as sample_rules
from april_server.rules import turns as turn_rules
from april_server.runtime.background import OWNER as BACKGROUND
from april_server.runtime.background import Background
from april_server.runtime.live_calls import LiveCalls
from april_server.runtime.persister import Persister
from april_server.runtime.run_to_end import run_to_end
from april_server.wire.errors import ApiError, bad_request, not_found
from april_server.wire.ids import split_sample_id


@dataclass(eq=False)
class PostInput:
    engine: BaseEngine  # tokenizes a text answer; the context and vocabulary bounds
    calls: LiveCalls
    buffer: PartialBuffer
    background: Background
    persister: Persister
    # One answer per group at a time: group id -> [its lock, answers using it].
    locks: dict[str, tuple[asyncio.Lock, list[int]]] = field(default_factory=dict, init=False)

    async def __call__(self, sample_id: str, req: InputReq) -> InputResp:
        if (req.append_ids is None) == (req.text is None):
            raise bad_request("invalid_request", "give exactly one of append_ids, text")
        parts = split_sample_id(sample_id)
        if parts is None or not self.buffer.known(parts[0]):
            raise not_found(f"unknown sample_id {sample_id!r}")
        gid = parts[0]
        if req.append_ids is not None:
            ids = list(req.append_ids)
        else:  # a tokenizer may take a while on a long answer: off the event loop
            # Appended mid-context: no special tokens (a BOS before every answer, with Llama,
            # Mistral or Gemma tokenizers, is not what the trainer's own encoding has there).
            ids = await asyncio.to_thread(self.engine.tokenize, req.text or "", False)
        lock, users = self.locks.setdefault(gid, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                return await self._take(sample_id, gid, ids, req.turn)
        finally:
            users[0] -= 1
            if not users[0]:
                del self.locks[gid]

    async def _take(self, sample_id: str, gid: str, ids: list[int], turn: int | None) -> InputResp:
        while True:
            holder = await self._holder(gid, sample_id)  # waits out a claim reading its body
            if holder is None:  # idle: taken here, with no await between look and claim
                return await self._answer_idle(sample_id, gid, ids, turn)
            call = self.calls.get(holder.owner)
            if call is not None:
                if call.state.stopped:  # winding down: take it once the call handed the group back
                    await call.state.closed.wait()
                    continue
                sample = self.buffer.claimed_sample(sample_id)
                self._check(sample, ids, turn)
                turn_rules.apply_answer(sample, ids)
                if call.turns.holds_for_input(sample):
                    call.turns.continue_answered(sample)
                # Continued or not (an abort named the group during the call: the member waits
                # idle after it), the answer is in the call's copy, durable with the call's
                # outcome: the route names the call. Null would say "made durable already",
                # which a call that never commits (the process dies, its store fails) belies.
                return InputResp(sample=sample, batch_id=call.state.batch_id)
            if holder.owner != BACKGROUND:  # a resume or a delete: 409 group_busy
                return await self._answer_idle(sample_id, gid, ids, turn)
            async with self.background.paused():  # handed back first, like for a call
                if await self._holder(gid, sample_id) is None:
                    return await self._answer_idle(sample_id, gid, ids, turn)
            # A call took the group while the background paused: look again, answer there.

    async def _holder(self, gid: str, sample_id: str) -> Holder | None:
        try:
            return await self.buffer.resolve(gid)
        except ApiError:
            raise not_found(f"unknown sample_id {sample_id!r}") from None

    def _answer_idle(
        self, sample_id: str, gid: str, ids: list[int], turn: int | None
    ) -> Awaitable[InputResp]:
        """Take the group now, synchronously, then answer to the end in a task. Taken inside
        that task instead, a call could claim the group between the caller's look and the
        task's start, and an answer that the look found idle would get 409 `group_busy` (a
        second answer then said `group_busy`, not `not_awaiting`: seen in
        `test_turns_properties`)."""
        owner = f"input-{uuid.uuid4().hex[:12]}"
        entries = self.buffer.take([gid], owner, busy_code="group_busy")
        return run_to_end(self._answer_taken(entries, owner, sample_id, ids, turn))

    async def _answer_taken(
        self,
        entries: list[BufferEntry],
        owner: str,
        sample_id: str,
        ids: list[int],
        turn: int | None,
    ) -> InputResp:
        try:
            (group,) = await self.buffer.arrive(entries)
            sample = self.buffer.claimed_sample(sample_id)
            self._check(sample, ids, turn)
            turn_rules.apply_answer(sample, ids)
            await self.persister.persist([group], [])  # durable before the route answers
        finally:
            self.buffer.release(owner)
            self.background.kick()  # a group it wants, passed over while held here
        return InputResp(sample=sample, batch_id=None)

    def _check(self, sample: Sample, ids: list[int], turn: int | None) -> None:
        turn_rules.check_answer(sample, ids, self.engine.vocab_size, turn)
        sample_rules.check_budget(
            len(sample.prompt_ids),
            sample_rules.num_appended(sample) + len(ids),
            sample.max_new_tokens,
            self.engine.context_len,
            f"sample {sample.sample_id!r}",
        )
