"""What the simulated clients saw, and the checks against it.

The ledger records only what the server acknowledged (responses), plus the background bound
the server says it recorded when a `continue` call or `/groups` handed a group in. Checks:
- a group id is created by at most one request, and delivered at most once;
- after the drain every acknowledged group is delivered, dropped, deleted or buffered;
- every delivered sample is whole (finished, segments cover its output, tokens are the
  engine's continuation of its context with the answers it took, in order);
- a group handed to the background with `max_staleness` b is delivered with every kept token
  at most b versions behind the version its delivering call started under;
- every answer the server took is in its sample exactly once, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from april_client.protocol import Group, Sample
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

    def loosen(self, bound: int | None) -> None:
        if self.unseen_bound is not None:
            self.unseen_bound = None if bound is None else max(self.unseen_bound, bound)

    def create(self, gid: str, by: str) -> None:
        earlier = self.created.get(gid)
        require(earlier is None or earlier == by, f"group {gid} created twice: {earlier}, {by}")
        self.created[gid] = by
        self.acked.add(gid)

    def deliver(self, groups: list[Group], start_version: int) -> None:
        for g in groups:
            gid = g.group_id
            self.delivered[gid] = self.delivered.get(gid, 0) + 1
            require(self.delivered[gid] == 1, f"group {gid} delivered twice")
            bound = self.bounds.get(gid)
            if bound is not None and self.unseen_bound != -1:
                bound = None if self.unseen_bound is None else max(bound, self.unseen_bound)
            self.leave(gid)
            self.bodies.append(g)
            for s in g.samples:
                require(s.status in ("completed", "truncated"), f"{s.sample_id} {s.status}")
                if bound is not None and s.segments:
                    lag = start_version - int(s.segments[0].weight_version)
                    require(
                        lag <= bound,
                        f"{s.sample_id} delivered {lag} versions stale, past the background "
                        f"bound {bound} (call started at version {start_version})",
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

    def check_sample(self, s: Sample) -> None:
        """Tokens are the engine's continuation of the context; answers once, in order."""
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
        took = self.answers.get(s.sample_id, [])
        held = [a.ids for a in s.appended]
        require(_ends_with(took, held), f"{s.sample_id} holds answers {held}, server took {took}")


def _ends_with(took: list[tuple[list[int], bool]], held: list[list[int]]) -> bool:
    """Whether `held` is what the tail of `took` leaves, skipping uncertain answers."""
    i = len(took) - 1
    for ids in reversed(held):
        while i >= 0 and not took[i][1] and took[i][0] != ids:
            i -= 1
        if i < 0 or took[i][0] != ids:
            return False
        i -= 1
    return True
