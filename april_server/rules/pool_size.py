"""How many groups a call should have in play (`stats.groups_wanted`). Pure Python.

APRIL's over-provisioning is a client's fixed factor (slime's `over_sampling_batch_size`,
2 x the quota by default). A call can only run what it holds: as its groups finish the running
batch drains, and on an engine whose throughput still rises with the batch (a small model, a
memory-bound decode) every drained slot is lost throughput. The server knows both sides of
the right size: the running batch worth keeping (`rules/inflight.py`, from the engine's
measured step curve) and how long what it holds will still run (`rules/lengths.py`).

So after a call, it plays the next call forward: the groups it carries over (each member at
its predicted remaining length) start first, then fresh groups (members drawn from the lengths
recently seen to finish), whole groups admitted while the running samples stay within the
target, exactly as a call's refill admits them; the play stops when the quota's worth of
groups has finished. The groups started by then, and never fewer than those carried, are
what the next call should hold: fewer and its batch drains below the target before its quota
is met; more sit unstarted.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

# A bound on the advice, in multiples of the quota: every group held beyond the quota is work
# in progress that a trainer carries into later steps (staleness), `W / K - 1` steps' worth on
# average, and more for the long ones, which finish last. 4 x the quota was measured to reach
# the engine's best batch on our CPU (docs/benchmarks.md); a call's `max_staleness` bounds it
# further (`bound_per_quota`).
MAX_WANTED_PER_QUOTA = 4


# With a weight push between calls, every carried group is re-prefilled under the new weights
# and consumed a version staler: there the advice stays within slime's 2 x (what APRIL holds
# anyway). Measured on the four reference configurations (a push after every step), 4 x at
# every call lost x0.84-0.93 to APRIL on three of them (docs/benchmarks.md). "Pushes between
# calls": the version changed between either of the last `PUSH_MEMORY` pairs of advised calls
# (a trainer pushing every other step would otherwise be advised 4 x just before each push),
# or no pair seen yet: a first advice of 4 x under pushes after every step (the common RL
# case) gave x0.97-1.01 APRIL's throughput in one sweep and x1.00-1.21 in another (noise), and
# every time more staleness (20-39 % of tokens 2+ versions old vs 10-22 %).
PUSHED_PER_QUOTA = 2
PUSH_MEMORY = 2
# The running target the advice plays at is the median of the last calls' targets for the
# same call shape (quota x group size): one call's knee moves with the curve's noise (16 to 61
# samples on our CPU, where the curve is nearly flat past ~30), and the pool moved between 2
# and 20 groups with it. Keyed by shape so that interleaved callers (training and evaluation,
# several trainers) do not smooth each other's targets.
SMOOTHING_CALLS = 5
MAX_SHAPES = 64  # call shapes remembered (beyond: forgotten and started afresh)


def bound_per_quota(max_staleness: int | None, pushed: bool = False) -> int:
    """The advice's bound in multiples of the quota: with `max_staleness = s`, a group may be
    carried s steps, so at most s + 1 quotas' worth is held (s = 1: slime's 2 x); with a push
    between calls (`pushed`), at most `PUSHED_PER_QUOTA`."""
    bound = PUSHED_PER_QUOTA if pushed else MAX_WANTED_PER_QUOTA
    if max_staleness is not None:
        bound = min(bound, max_staleness + 1)
    return max(1, bound)


@dataclass
class PoolAdvisor:
    """What the advice remembers across calls (one per server): the recent running targets
    by call shape, the weight version the last advised call ended under, and whether it
    changed between the last pairs of advised calls."""

    targets: dict[tuple[int, int], deque[int]] = field(default_factory=dict)
    version: str | None = None
    pushes: deque[bool] = field(default_factory=lambda: deque(maxlen=PUSH_MEMORY))

    def forget(self) -> None:
        """The lengths it played from were forgotten: the next advice starts afresh."""
        self.targets.clear()
        self.version = None
        self.pushes.clear()

    def advise(
        self,
        target_groups: int,
        running_target: int,
        version: str,
        carried: Sequence[Sequence[float]],
        fresh_lengths: Sequence[int],
        group_size: int,
        max_staleness: int | None,
    ) -> int | None:
        """`groups_wanted` at the smoothed running target, bounded by `bound_per_quota`. The
        first advice has nothing to compare its version with: it is bounded as under pushes
        (the cadence unknown), and 4 x waits for a pair of calls with no push between."""
        if self.version is not None:
            self.pushes.append(self.version != version)
        self.version = version
        shape = (target_groups, group_size)
        if shape not in self.targets and len(self.targets) >= MAX_SHAPES:
            self.targets.clear()
        recent = self.targets.setdefault(shape, deque(maxlen=SMOOTHING_CALLS))
        recent.append(running_target)
        smoothed = sorted(recent)[len(recent) // 2]
        pushed = not self.pushes or any(self.pushes)
        per_quota = bound_per_quota(max_staleness, pushed)
        return groups_wanted(target_groups, smoothed, carried, fresh_lengths, group_size, per_quota)


def _fresh_groups(lengths: Sequence[int], group_size: int) -> Iterator[list[float]]:
    """Endless fresh groups whose members cycle through `lengths` in a fixed shuffled order
    (deterministic: the same history gives the same advice)."""
    order = list(lengths)
    random.Random(len(order)).shuffle(order)
    k = 0
    while True:
        group = []
        for _ in range(group_size):
            group.append(float(max(order[k % len(order)], 1)))
            k += 1
        yield group


def groups_wanted(
    target_groups: int,
    running_target: int,
    carried: Sequence[Sequence[float]],
    fresh_lengths: Sequence[int],
    group_size: int,
    per_quota: int = MAX_WANTED_PER_QUOTA,
) -> int | None:
    """Groups the next call should hold (carried + new), at most `per_quota` x the quota
    (never fewer than it carries). `carried`: each carried group's unfinished members'
    predicted remaining tokens (an empty group has finished); `fresh_lengths`: lengths
    recently seen to finish; `group_size`: members of a fresh group. None: no lengths seen
    yet (no evidence)."""
    if target_groups < 1 or running_target < 1 or group_size < 1 or not fresh_lengths:
        return None
    limit = max(per_quota * target_groups, len(carried))
    fresh = _fresh_groups(fresh_lengths, group_size)
    queue = iter(carried)
    waiting: list[float] | None = None  # the head of the queue, waiting for room
    ends: list[tuple[float, int]] = []  # (finish time in decode steps, started group)
    left: list[int] = []  # unfinished members per started group
    running = finished = 0
    now = 0.0
    while True:
        # Admit whole groups in queue order while the running samples stay within the
        # target (the first always: a call with nothing running starts one regardless).
        while finished < target_groups and len(left) < limit:
            if waiting is None:
                head = next(queue, None)
                waiting = list(head) if head is not None else next(fresh)
            if running and running + len(waiting) > running_target:
                break
            left.append(len(waiting))
            running += len(waiting)
            finished += not waiting
            for remaining in waiting:
                heapq.heappush(ends, (now + max(remaining, 1.0), len(left) - 1))
            waiting = None
        if finished >= target_groups or not ends:
            return min(max(len(left), len(carried), target_groups), limit)
        # Every running sample makes one token per decode step: the next to end ends next
        # (all that end at that step together, before any room is filled).
        now = ends[0][0]
        while ends and ends[0][0] == now:
            gi = heapq.heappop(ends)[1]
            running -= 1
            left[gi] -= 1
            finished += left[gi] == 0
