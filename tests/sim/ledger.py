"""What the simulated clients saw, and the checks against it.

The ledger records only what the server acknowledged (responses), plus the background bound
the server says it recorded when a `continue` call or `/groups` handed a group in. Checks:
- a group id is created by at most one request, and delivered at most once; a group reported
  dropped or deleted is never delivered after (nor buffered, `World.quiet_check`);
- after the drain every acknowledged group is delivered, dropped, deleted or buffered;
- every delivered sample is whole (finished, segments cover its output, tokens are the
  engine's continuation of its context with the answers it took, in order; its routed
  experts, where asked, the engine's for each position under the version that computed it);
- a group handed to the background with `max_staleness` b is delivered with every kept token
  at most b versions behind the version its delivering call started under;
- a call's own `max_staleness` b: every segment that one of its own requests made (the
  engine's log says who planned each request, and under which version it started) continues
  a segment at most b versions older, or the call should have restarted the sample;
- every answer the server took is in its sample exactly once, in order.
A crash makes some outcomes uncertain (`maybe_gone`, answers not yet durable): those are
judged as either.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from april_client.protocol import Group, Sample
from april_server.rules.routing_replay import row_bytes
from april_server.rules.samples import context_ids
from tests.sim.engine import Request, routed
from tests.unit.fake_engine import EOS, next_token

VOCAB = 64


class CheckFailed(AssertionError):
    pass


def require(ok: bool, what: str) -> None:
    if not ok:
        raise CheckFailed(what)


@dataclass
class Ledger:
    created: dict[str, str] = field(default_factory=dict)  # group id -> the request that made it
    acked: set[str] = field(default_factory=set)  # groups the server acknowledged holding
    delivered: dict[str, int] = field(default_factory=dict)  # group id -> times delivered
    dropped: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    bounds: dict[str, int] = field(default_factory=dict)  # background max_staleness per group
    handed_by: dict[str, str] = field(default_factory=dict)  # group -> the batch that handed it
    background: set[str] = field(default_factory=set)  # groups the background should want
    # sample -> answers posted (ids, whether the server said it took it), in order
    answers: dict[str, list[tuple[list[int], bool]]] = field(default_factory=dict)
    bodies: list[Group] = field(default_factory=list)  # delivered bodies
    answered: dict[str, str] = field(default_factory=dict)  # request_id -> batch it answered
    # A `continue` call whose client went away hands groups to the background with its own
    # bound, unseen: bounds are then checked at the loosest one it may have set.
    unseen_bound: int | None = -1
    # Acknowledged groups an unacknowledged operation may have removed as the process died
    # (a call that delivered or dropped them, a delete): gone or not, both are right.
    maybe_gone: set[str] = field(default_factory=set)
    # sample -> (index in `answers`, the call that took it): an answer a call took is durable
    # only with that call's outcome (docs/api.md, Turns).
    taken_by: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    # sample -> per answer in `answers`: (the member's staleness restarts as it took it, the
    # `drops` epoch then): an answer the member still holds unless reset since.
    answer_resets: dict[str, list[tuple[int, tuple[int, int]]]] = field(default_factory=dict)
    drops: int = 0  # aborts with `keep: drop` of everything or a batch begun
    dropping: int = 0  # aborts with `keep: drop` under way
    group_drops: dict[str, int] = field(default_factory=dict)  # ... of named groups, by group
    # Groups a commit that failed would have written (`store.Disk.failed_groups`).
    failed_groups: Callable[[], set[str]] = set
    # The engine's log of requests by sample (who planned each, under which version).
    requests_of: Callable[[str], list[Request]] = lambda sid: []

    def loosen(self, bound: int | None) -> None:
        if self.unseen_bound is not None:
            self.unseen_bound = None if bound is None else max(self.unseen_bound, bound)

    def create(self, gid: str, by: str) -> None:
        earlier = self.created.get(gid)
        require(earlier is None or earlier == by, f"group {gid} created twice: {earlier}, {by}")
        self.created[gid] = by
        self.acked.add(gid)

    def deliver(
        self,
        groups: list[Group],
        start_version: int,
        own_bound: int | None = None,
        batch_id: str = "",
    ) -> None:
        """A call (`batch_id`, its own `max_staleness`) delivered `groups`."""
        for g in groups:
            gid = g.group_id
            self.delivered[gid] = self.delivered.get(gid, 0) + 1
            require(self.delivered[gid] == 1, f"group {gid} delivered twice")
            require(gid not in self.dropped, f"group {gid} delivered after it was dropped")
            require(gid not in self.deleted, f"group {gid} delivered after it was deleted")
            bound = self.bounds.get(gid)
            if bound is not None and self.unseen_bound != -1:
                bound = None if self.unseen_bound is None else max(bound, self.unseen_bound)
            self.leave(gid)
            self.bodies.append(g)
            for s in g.samples:
                require(s.status in ("completed", "truncated"), f"{s.sample_id} {s.status}")
                self.check_own_bound(s, own_bound, batch_id)
                if bound is not None and s.segments:
                    lag = start_version - int(s.segments[0].weight_version)
                    require(
                        lag <= bound,
                        f"{s.sample_id} delivered {lag} versions stale, past the background "
                        f"bound {bound} (call started at version {start_version})",
                    )

    def check_own_bound(self, s: Sample, bound: int | None, batch_id: str) -> None:
        """Each segment the call's own requests made continues one at most `bound` versions
        older (`samples.plan_continuation`: else the sample restarts from its prompt)."""
        if bound is None or not batch_id:
            return
        requests = self.requests_of(s.sample_id)
        for k in range(1, len(s.segments)):
            seg, before = s.segments[k], s.segments[k - 1]
            sent = len(s.prompt_ids) + sum(len(a.ids) for a in s.appended if a.at <= seg.start)
            made = [r for r in requests if r.index == k and r.context == sent + seg.start]
            if not made or made[-1].owner != batch_id:
                continue  # made by another owner: judged by its rule
            lag = int(made[-1].version) - int(before.weight_version)
            require(
                lag <= bound,
                f"{s.sample_id} segment {k} continued a segment {lag} versions old in call "
                f"{batch_id}, past its own max_staleness {bound}",
            )

    def bound(self, gid: str, max_staleness: int | None) -> None:
        """The group was handed to the background with this bound (the latest counts)."""
        if max_staleness is None:
            self.bounds.pop(gid, None)
        else:
            self.bounds[gid] = max_staleness

    def leave(self, gid: str) -> None:
        self.background.discard(gid)
        self.bounds.pop(gid, None)

    def check_sample(self, s: Sample, answers: bool = True) -> None:
        """Tokens are the engine's continuation of the context; answers once, in order (not
        judged with `answers=False`: a body shown while an answer's response is on its way)."""
        require(len(s.output_ids) == len(s.output_logprobs), f"{s.sample_id} logprobs")
        covered = sum(x.end - x.start for x in s.segments)
        require(covered == len(s.output_ids), f"{s.sample_id} segments cover {covered}")
        ctx = list(s.prompt_ids)
        appended = list(s.appended)
        for i, tok in enumerate(s.output_ids):
            while appended and appended[0].at == i:
                ctx += appended.pop(0).ids
            require(tok == next_token(ctx, VOCAB), f"{s.sample_id} token {i} is not the engine's")
            ctx.append(tok)
        if s.status == "completed" and s.turn_rule is None:
            require(s.output_ids[-1:] == [EOS], f"{s.sample_id} completed without EOS")
        # A drop or a staleness restart forgets a member's answers with its output: what it
        # holds are the last answers taken, in order, none twice (one whose client went away
        # may or may not have been taken).
        check_routing(s)
        if not answers:
            return
        took = self.answers.get(s.sample_id, [])
        held = [a.ids for a in s.appended]
        require(_ends_with(took, held), f"{s.sample_id} holds answers {held}, server took {took}")
        # And every answer it took is still there, unless the member was reset since (a
        # staleness restart counts on the sample; an abort with `keep: drop` on the epoch).
        drops = self.drops_of(s.group_id)
        resets = self.answer_resets.get(s.sample_id, [])
        # One a call took is durable with that call's commit, which may have failed unseen (the
        # call's client gone): not judged once a commit of its group failed.
        in_calls = {i for i, _ in self.taken_by.get(s.sample_id, [])}
        failed = s.group_id in self.failed_groups()
        for i, ((ids, taken), (restarts, then)) in enumerate(zip(took, resets, strict=True)):
            if not taken or restarts != s.staleness_restarts or then != drops:
                continue
            if i in in_calls and failed:
                continue
            require(ids in held, f"{s.sample_id} lost the answer {ids} it took: holds {held}")

    def drops_of(self, gid: str) -> tuple[int, int]:
        """Aborts with `keep: drop` that may have reset the group's members: (those naming
        no group, those naming this one)."""
        return self.drops, self.group_drops.get(gid, 0)

    def answer_taken(
        self,
        sid: str,
        ids: list[int],
        taken: bool,
        batch_id: str | None,
        restarts: int = -1,
    ) -> None:
        """`restarts`: the member's staleness restarts as it took the answer (-1: unknown)."""
        mine = self.answers.setdefault(sid, [])
        if batch_id is not None:
            self.taken_by.setdefault(sid, []).append((len(mine), batch_id))
        mine.append((ids, taken))
        gid = sid.rpartition("/")[0]
        if self.dropping:  # an abort with `keep: drop` under way may reset it still
            restarts = -1
        self.answer_resets.setdefault(sid, []).append((restarts, self.drops_of(gid)))

    def batches_taking(self) -> set[str]:
        """The calls that took an answer."""
        return {b for taken in self.taken_by.values() for _, b in taken}

    def not_durable(self, live_calls: set[str]) -> None:
        """Answers taken by these calls are uncertain: they died, or failed, before their
        outcome was made durable (the process died, the store failed)."""
        for sid, taken in self.taken_by.items():
            for i, batch_id in taken:
                if batch_id in live_calls:
                    self.answers[sid][i] = (self.answers[sid][i][0], False)


def check_routing(s: Sample) -> None:
    """Every recorded row of routed experts is the engine's for that position of the
    sample's context, under the weight version its span says computed it."""
    r = s.routing
    if r is None:
        return
    rb = row_bytes(r.num_layers, r.top_k, r.dtype)
    ctx = context_ids(s)
    require(len(r.experts) % rb == 0, f"{s.sample_id}: routing rows cut short")
    require(r.num_positions <= len(ctx), f"{s.sample_id}: routing for {r.num_positions} positions")
    at = 0
    for span in r.spans:
        require(span.start == at, f"{s.sample_id}: routing spans leave a gap at {at}")
        at = span.end
        if span.missing:
            continue
        for p in range(span.start, span.end):
            row = r.experts[p * rb : (p + 1) * rb]
            want = routed(ctx[: p + 1], span.weight_version)
            require(row == want, f"{s.sample_id}: routing row {p} is not the engine's")
    require(at == r.num_positions, f"{s.sample_id}: spans end at {at}, rows at {r.num_positions}")
    for rec in r.recomputed:
        for p in range(rec.start, rec.end):
            row = rec.experts[(p - rec.start) * rb : (p - rec.start + 1) * rb]
            want = routed(ctx[: p + 1], rec.weight_version)
            require(row == want, f"{s.sample_id}: recomputed routing row {p} is not the engine's")


def _ends_with(took: list[tuple[list[int], bool]], held: list[list[int]]) -> bool:
    """Whether `held` is what the tail of `took` leaves: each answer the server took, in order,
    from some point on (a reset forgets those before), each uncertain one there or not."""

    @functools.cache
    def tail(i: int, j: int) -> bool:  # held[: j + 1] ends took[: i + 1]
        if j < 0:
            return True
        if i < 0:
            return False
        ids, certain = took[i]
        if ids == held[j] and tail(i - 1, j - 1):
            return True
        return not certain and tail(i - 1, j)

    return tail(len(took) - 1, len(held) - 1)
