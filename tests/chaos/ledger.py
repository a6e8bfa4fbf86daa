"""The chaos client's ledger (pure): what it sent, what the server acknowledged, where every
acknowledged group ended, and the checks of `tests.chaos.harness`.

- A group is *acknowledged* once a call that sent it answered 200 (its groups were adopted),
  or a streamed call that sent it started its stream (the same, before the first line).
- A group whose call's fate is unknown (the client abandoned it, or timed out) is *pending*
  until a retry of that call's `request_id` says what became of it: a retry returns the
  stored answer of an attempt that delivered, or runs again on what the attempt handed in.
- Delivered: returned by a call whose answer the client read whole (for a retry, the answer
  is deduplicated by `request_id`: the same stored answer twice is one delivery).
- Gone: deleted (`DELETE` answered 200) or dropped (`dropped_group_ids`).
After the drain, every acknowledged group must be delivered exactly once or gone, and nothing
delivered may be unknown or incomplete; nothing may be left running, awaiting input or held.
Agent episodes: a tool answer refused 404 for a sample the client saw announced as awaiting,
while its group was still on the server (a look right after says so), is a failure; so is a
delivered sample with a turn stop inside a turn (its tool call merged into a longer turn).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ChaosLedger:
    acknowledged: set[str] = field(default_factory=set)
    maybe: set[str] = field(default_factory=set)  # sent by calls of unknown fate
    delivered: Counter[str] = field(default_factory=Counter)
    gone: set[str] = field(default_factory=set)
    answers: dict[str, str] = field(default_factory=dict)  # request_id -> batch_id delivered
    statuses: Counter[int] = field(default_factory=Counter)
    ops: Counter[str] = field(default_factory=Counter)
    hangs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    no_engine: int = 0  # 503 no_engine (owner mode, while no engine is healthy)
    reused: set[str] = field(default_factory=set)  # ids sent again after their delivery
    final: list[str] = field(default_factory=list)  # the failed checks, once run
    story: dict[str, list[str]] = field(default_factory=dict)  # group id -> what happened
    # Snapshot bytes held once drained, before the server's sweep (if any) freed leaks, and
    # what the sweep freed during the whole run: non-zero means a leak happened and was caught.
    held_at_drain: int = 0
    swept: int = 0
    answers_taken: Counter[int] = field(default_factory=Counter)  # tool answers, by status
    left_over: dict[str, int] = field(default_factory=dict)  # running/awaiting once drained

    def answer_refused(self, sample_id: str, code: int, group_there: bool) -> None:
        """A tool answer for a sample announced as awaiting got `code`; `group_there`: the
        group was on the server when the client looked right after."""
        self.answers_taken[code] += 1
        if code == 404 and group_there:
            self.errors.append(f"input 404 for {sample_id}, announced awaiting, group on server")

    def status(self, what: str, code: int, body: str = "") -> None:
        self.statuses[code] += 1
        if code == 503 and "no_engine" in body:
            self.no_engine += 1
        elif code >= 500:
            self.errors.append(f"{what}: HTTP {code} {body[:200]}")

    def sent(self, gids: list[str], acknowledged: bool, how: str = "") -> None:
        (self.acknowledged if acknowledged else self.maybe).update(gids)
        for g in gids:
            self.story.setdefault(g, []).append(f"sent by {how or 'a call'}")

    def answered(self, request_id: str | None, resp: dict[str, Any]) -> None:
        """A call's whole answer: its groups are delivered (once per request_id)."""
        if request_id is not None:
            if self.answers.get(request_id) == resp["batch_id"]:
                return  # the stored answer again: not a second delivery
            self.answers[request_id] = resp["batch_id"]
        for g in resp["groups"]:
            self.delivered[g["group_id"]] += 1
            self.story.setdefault(g["group_id"], []).append(f"delivered by {resp['batch_id']}")
            self.errors.extend(whole(g))
        for gid in resp.get("dropped_group_ids") or []:
            self.gone.add(gid)
            self.story.setdefault(gid, []).append(f"dropped by {resp['batch_id']}")

    def check(
        self,
        buffered_after_drain: int,
        snapshot_bytes_after_drain: int,
        left: dict[str, int] | None = None,
    ) -> list[str]:
        """Every failed check, in words (what went wrong during the run included); empty
        when all hold. `left`: the server's figures of what still runs, awaits or is held once
        drained (all must be 0)."""
        bad = list(self.errors)
        bad += [f"{n} {what} after the drain" for what, n in sorted((left or {}).items()) if n]
        bad += [f"hang: {h}" for h in self.hangs]
        twice = [g for g, n in self.delivered.items() if n > (2 if g in self.reused else 1)]
        if twice:
            bad.append(f"{len(twice)} groups delivered more than once, e.g. {twice[:3]}")
        known = self.acknowledged | self.maybe
        unknown = [g for g in self.delivered if g not in known]
        if unknown:
            bad.append(f"{len(unknown)} delivered groups were never sent, e.g. {unknown[:3]}")
        lost = sorted(self.acknowledged - set(self.delivered) - self.gone)
        if lost:
            told = "; ".join(f"{g}: {', '.join(self.story.get(g, []))}" for g in lost[:3])
            bad.append(f"{len(lost)} acknowledged groups unaccounted for: {told}")
        if buffered_after_drain:
            bad.append(f"{buffered_after_drain} groups still buffered after the drain")
        if snapshot_bytes_after_drain:
            bad.append(f"{snapshot_bytes_after_drain} snapshot bytes held after the drain")
        return bad


def whole(group: dict[str, Any]) -> list[str]:
    """What is wrong with a delivered group (tokens, logprobs and segments must agree)."""
    out = []
    for s in group["samples"]:
        sid = s["sample_id"]
        n = len(s["output_ids"])
        if len(s["output_logprobs"]) != n:
            out.append(f"{sid}: {n} tokens, {len(s['output_logprobs'])} logprobs")
        pos = 0
        for seg in s["segments"]:
            if seg["start"] != pos or seg["end"] < seg["start"]:
                out.append(f"{sid}: segments not contiguous at {pos}")
                break
            pos = seg["end"]
        if pos != n:
            out.append(f"{sid}: segments cover {pos} of {n} tokens")
        if s["status"] not in ("completed", "truncated"):
            out.append(f"{sid}: delivered as {s['status']}")
        out += merged_turns(s)
    return out


def merged_turns(s: dict[str, Any]) -> list[str]:
    """An agent sample's turn stop token inside a turn (not at its end): a tool call the
    server let run on (issue #36)."""
    rule = s.get("turn_rule") or {}
    stops = set(rule.get("stop_token_ids") or [])
    if not stops:
        return []
    ids = s["output_ids"]
    out = []
    for t in s.get("turns") or []:
        inside = [i for i in range(t["start"], t["end"] - 1) if ids[i] in stops]
        if inside:
            out.append(f"{s['sample_id']}: a turn stop at {inside[0]} inside turn {t}")
    return out
