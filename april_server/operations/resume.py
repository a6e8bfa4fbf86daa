"""`POST /april/v1/resume`: continue named buffered samples now, outside any call.

1. Check the request (ids, appends, sampling overrides) before anything changes.
2. Pause the background, claim the samples' groups, and check each sample can resume (not
   finished, not awaiting an answer without one, a usable snapshot when `kv: restore`).
3. Apply the appends (a tool's answer, or context), run one segment per sample, persist the
   groups and release them, even if the caller went away meanwhile.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from april_client.protocol import ResumeReq, Sample
from april_server.buffer.partial_buffer import PartialBuffer
from april_server.engine.base import BaseEngine
from april_server.engine.segment_planner import SegmentPlanner
from april_server.engine.segment_runner import SegmentRunner
from april_server.engine.segment_state import CallTally, Counters
from april_server.engine.versions import WeightVersions
from april_server.rules import samples as sample_rules
from april_server.rules import sampling_mask as mask_rules
from april_server.rules import turns as turn_rules
from april_server.rules.routing_replay import check_wanted as check_routing
from april_server.runtime.background import Background
from april_server.runtime.persister import Persister
from april_server.runtime.run_to_end import run_to_end
from april_server.wire.errors import bad_request, conflict, not_found
from april_server.wire.ids import split_sample_id


@dataclass(eq=False)
class Resume:
    engine: BaseEngine  # checks params, appends and budgets
    buffer: PartialBuffer
    background: Background
    segments: SegmentRunner
    planner: SegmentPlanner  # whether a snapshot is usable for `kv: restore`
    versions: WeightVersions  # which snapshots a `kv: restore` may use
    persister: Persister
    counters: Counters

    async def __call__(self, req: ResumeReq) -> list[Sample]:
        self.counters.resume_calls += 1
        if not req.sample_ids:
            raise bad_request("invalid_request", "sample_ids is empty")
        if len(set(req.sample_ids)) != len(req.sample_ids):
            raise bad_request("duplicate_sample_id", "sample_ids contains duplicates")
        appends = req.append_ids or {}
        stray = set(appends) - set(req.sample_ids)
        if stray:
            raise bad_request("invalid_request", f"append_ids for unlisted samples: {stray}")
        if req.sampling_params:
            if "max_new_tokens" in req.sampling_params:
                raise bad_request(
                    "invalid_request", "the budget is the sample's own; omit max_new_tokens"
                )
            self.engine.check_sampling_params(req.sampling_params)
        parsed = {sid: split_sample_id(sid) for sid in req.sample_ids}
        for sid, parts in parsed.items():
            if parts is None or not self.buffer.known(parts[0]):
                raise not_found(f"unknown sample_id {sid!r}")
        gids = sorted({parts[0] for parts in parsed.values() if parts is not None})
        owner = f"resume-{uuid.uuid4().hex[:12]}"
        # Claimed, run and persisted to the end even if the caller goes away meanwhile: a
        # release before the segments ended would drop what they record (tokens, snapshots).
        async with self.background.paused():
            return await run_to_end(self._resume_claimed(req, gids, owner, appends))

    async def _resume_claimed(
        self,
        req: ResumeReq,
        gids: list[str],
        owner: str,
        appends: dict[str, list[int]],
    ) -> list[Sample]:
        try:
            for gid in gids:  # a claim whose body is still being read: wait it out, then 409
                await self.buffer.resolve(gid)
            await self.buffer.claim(gids, owner, busy_code="sample_busy")
            chosen = [self.buffer.claimed_sample(sid) for sid in req.sample_ids]
            self._check_resumable(req, chosen, appends)
            if req.return_routed_experts is not None:
                for (
                    s
                ) in chosen:  # from this segment on (rules/routing_replay.py: earlier rows unknown)
                    s.return_routed_experts = req.return_routed_experts
            if req.return_sampling_mask is not None:
                for s in chosen:  # earlier tokens get empty rows (rules/sampling_mask.py)
                    mask_rules.switch(s, req.return_sampling_mask)
            for sid, ids in appends.items():
                sample = self.buffer.claimed_sample(sid)
                if turn_rules.awaiting(sample):  # the tool's answer: recorded like POST .../input
                    turn_rules.apply_answer(sample, ids)
                else:
                    sample_rules.append_context(sample, ids, self.engine.context_len)
            tally = CallTally()
            tasks = [
                self.segments.start(s, owner, tally, req.max_staleness, req.sampling_params, req.kv)
                for s in chosen
                if sample_rules.remaining_budget(s) > 0 and not sample_rules.is_finished(s)
            ]
            for s in chosen:
                if sample_rules.remaining_budget(s) <= 0:
                    s.status, s.finish_reason = "truncated", "length"
            if tasks:
                await asyncio.gather(*tasks)
            await self.persister.persist([self.buffer.claimed[g] for g in gids], [])
        finally:
            self.buffer.release(owner)
        return chosen

    def _check_resumable(
        self, req: ResumeReq, chosen: list[Sample], appends: dict[str, list[int]]
    ) -> None:
        """Raise before anything changes: finished samples, missing snapshots, bad appends."""
        check_routing(bool(req.return_routed_experts), self.engine.routing_format, "resume")
        for s in chosen:
            params = {**s.sampling_params, **(req.sampling_params or {})}
            turn_rules.check_params(s.turn_rule, params, f"sample {s.sample_id!r}")
            wants_mask = req.return_sampling_mask
            if wants_mask if wants_mask is not None else s.return_sampling_mask:
                where = f"sample {s.sample_id!r}"
                mask_rules.check_params(params, self.engine.sampling_mask_tokens, where)
            if sample_rules.is_finished(s) and s.sample_id not in appends:
                raise conflict("sample_finished", f"sample {s.sample_id!r} is {s.status}")
            if turn_rules.awaiting(s) and s.sample_id not in appends:
                raise conflict(
                    "awaiting_input",
                    f"sample {s.sample_id!r} awaits input: give its answer in append_ids",
                )
            if req.kv == "restore" and not self.planner.usable(
                s, self.versions.now(), self.versions.history, req.max_staleness
            ):
                raise conflict(
                    "no_snapshot",
                    f"sample {s.sample_id!r} has no KV snapshot usable under weight version "
                    f"{self.versions.now()!r} (kv: auto re-prefills instead)",
                )
        for sid, ids in appends.items():
            if self.engine.vocab_size is not None and any(
                t < 0 or t >= self.engine.vocab_size for t in ids
            ):
                raise bad_request("invalid_token", f"append_ids[{sid!r}] has bad token ids")
            s = self.buffer.claimed_sample(sid)
            sample_rules.check_budget(
                len(s.prompt_ids),
                sample_rules.num_appended(s) + len(ids),
                s.max_new_tokens,
                self.engine.context_len,
                f"sample {sid!r}",
            )
