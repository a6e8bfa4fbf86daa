"""Sample accounting: every mode consumes the same number of samples per step, and no sample is
lost or duplicated across steps. Pure bookkeeping (no I/O), so a unit test can prove it.

A mode's `Ledger` records which workload groups were sent to the server, which the trainer
consumed at which step (with each member's token count), and which were still in the partial
buffer at the end. `check()` lists every violation; an empty list means the run is sound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

FINISHED = ("completed", "truncated")


@dataclass(frozen=True)
class Consumed:
    """One consumed member: `sample_id` is `"{group_id}/{member}"`."""

    sample_id: str
    group_id: str
    member: int
    tokens: int
    status: str


@dataclass
class Ledger:
    mode: str
    groups_per_step: int
    n: int
    exact_budgets: bool = True  # ignore_eos workloads: each sample generates exactly its budget
    sent: dict[str, int] = field(default_factory=dict)  # group_id -> workload index
    budgets: dict[str, tuple[int, ...]] = field(default_factory=dict)
    steps: list[list[Consumed]] = field(default_factory=list)
    leftover: dict[str, int] = field(default_factory=dict)  # group_id -> buffered tokens
    dropped: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def send(self, group_id: str, index: int, budgets: Sequence[int]) -> None:
        if group_id in self.sent:
            self.problems.append(f"group {group_id} sent twice")
        self.sent[group_id] = index
        self.budgets[group_id] = tuple(budgets)

    def consume(self, step: int, samples: Iterable[Consumed]) -> None:
        while len(self.steps) <= step:
            self.steps.append([])
        self.steps[step].extend(samples)

    def set_leftover(self, buffered_tokens: dict[str, int]) -> None:
        self.leftover = dict(buffered_tokens)

    @property
    def consumed_groups(self) -> list[str]:
        return [gid for step in self.steps for gid in dict.fromkeys(c.group_id for c in step)]

    def outstanding(self) -> set[str]:
        """Groups sent and neither consumed nor dropped: still on the server (prefetch sizes
        the next step's hand-in from it)."""
        return set(self.sent) - set(self.consumed_groups) - self.dropped

    def samples_per_step(self) -> list[int]:
        return [len(s) for s in self.steps]

    def consumed_tokens(self) -> int:
        return sum(c.tokens for step in self.steps for c in step)

    def check(self) -> list[str]:
        out = list(self.problems)
        want = self.groups_per_step * self.n
        seen: dict[str, int] = {}
        for i, step in enumerate(self.steps):
            gids = {c.group_id for c in step}
            if len(step) != want or len(gids) != self.groups_per_step:
                out.append(
                    f"step {i}: consumed {len(step)} samples in {len(gids)} groups, "
                    f"expected {want} in {self.groups_per_step}"
                )
            for c in step:
                if c.sample_id in seen:
                    out.append(
                        f"sample {c.sample_id} consumed twice (steps {seen[c.sample_id]}, {i})"
                    )
                seen[c.sample_id] = i
                out.extend(self._check_sample(c))
            for gid in gids:
                members = sorted(c.member for c in step if c.group_id == gid)
                if members != list(range(self.n)):
                    out.append(f"step {i}: group {gid} consumed with members {members}")
        consumed = set(self.consumed_groups)
        for gid in consumed & set(self.leftover):
            out.append(f"group {gid} is both consumed and still buffered")
        for gid in consumed & self.dropped:
            out.append(f"group {gid} is both consumed and dropped")
        lost = set(self.sent) - consumed - set(self.leftover) - self.dropped
        if lost:
            out.append(
                f"{len(lost)} sent group(s) lost (neither consumed nor buffered): "
                f"{sorted(lost)[:5]}"
            )
        return out

    def _check_sample(self, c: Consumed) -> list[str]:
        out = []
        if c.group_id not in self.sent:
            out.append(f"sample {c.sample_id} was never sent")
            return out
        if c.status not in FINISHED:
            out.append(f"sample {c.sample_id} consumed while {c.status}")
        budgets = self.budgets[c.group_id]
        if not 0 <= c.member < len(budgets):
            out.append(f"sample {c.sample_id}: member {c.member} out of range")
        elif self.exact_budgets and c.tokens != budgets[c.member]:
            out.append(f"sample {c.sample_id}: {c.tokens} tokens, budget {budgets[c.member]}")
        elif c.tokens > budgets[c.member]:
            out.append(f"sample {c.sample_id}: {c.tokens} tokens over budget {budgets[c.member]}")
        return out


def compare_modes(ledgers: Sequence[Ledger]) -> list[str]:
    """Every mode must consume the same number of samples at every step."""
    if not ledgers:
        return []
    ref = ledgers[0]
    out = []
    for led in ledgers[1:]:
        if led.samples_per_step() != ref.samples_per_step():
            out.append(
                f"{led.mode} consumed {led.samples_per_step()} samples per step, "
                f"{ref.mode} {ref.samples_per_step()}"
            )
    return out
