"""Agent rollouts: what a turn is, when a member awaits input, what an answer does.

Pure rules over samples (no I/O, no SGLang), used by the segments (`samples.plan_continuation`
adds the turn stops to every segment; `segment_runner.py` calls `end_of_segment` after recording
one), by calls (`turns_in_call.py`) and by `POST /samples/{id}/input` (`inputs.py`). See
docs/api.md, "Turns (agent rollouts)":
- a member whose segment ends at one of its turn stops, with budget left and fewer than
  `max_turns` turns, becomes `awaiting_input`: nothing of it runs until an answer arrives;
- an episode ends at EOS or a stop that is not a turn stop (`completed`), at its budget or at
  `max_turns` (`truncated`);
- every ended turn is recorded (`Sample.turns`): its span of `output_ids`, what ended it, its
  weight versions, and once answered how long it waited;
- an answer is appended context (`Sample.appended`, loss mask 0) and makes the member
  runnable again (`partial`).
"""

from __future__ import annotations

import time
from typing import Any, Final

from april_client.protocol import Appended, Sample, Turn, TurnEnd, TurnRule, TurnsSpec
from april_server.wire.errors import bad_request, conflict

AWAITING: Final = "awaiting_input"
MAX_TURN_STOPS = 64  # stop strings + stop token ids of one rule


def check_spec(spec: TurnsSpec | None, where: str, vocab_size: int | None) -> None:
    """Raise 400 `invalid_turns` for a rule that could never end a turn, or a bad one."""
    if spec is None:
        return
    if not spec.stop and not spec.stop_token_ids:
        raise bad_request("invalid_turns", f"{where}: turns needs stop or stop_token_ids")
    if len(spec.stop) + len(spec.stop_token_ids) > MAX_TURN_STOPS:
        raise bad_request("invalid_turns", f"{where}: at most {MAX_TURN_STOPS} turn stops")
    if any(not s for s in spec.stop):
        raise bad_request("invalid_turns", f"{where}: a turn stop string is empty")
    bad = [t for t in spec.stop_token_ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise bad_request(
            "invalid_turns", f"{where}: turn stop_token_ids {bad} lie outside the vocabulary"
        )
    if spec.max_turns is not None and spec.max_turns < 1:
        raise bad_request("invalid_turns", f"{where}: max_turns must be >= 1 or null")


def check_params(rule: TurnRule | None, params: dict[str, Any], where: str) -> None:
    """Raise 400 `invalid_turns` for turn stop token ids under `ignore_eos`: SGLang skips
    every stop token id then (EOS's and ours alike), so the turn would silently never end.
    Stop strings still end turns under `ignore_eos`."""
    if rule is not None and rule.stop_token_ids and params.get("ignore_eos"):
        raise bad_request(
            "invalid_turns",
            f"{where}: turn stop_token_ids cannot end a turn under ignore_eos (SGLang skips "
            "stop token ids then); drop ignore_eos, or end turns with stop strings",
        )


def rule_of(spec: TurnsSpec | None) -> TurnRule | None:
    if spec is None:
        return None
    return TurnRule(
        stop=list(spec.stop), stop_token_ids=list(spec.stop_token_ids), max_turns=spec.max_turns
    )


def with_turn_stops(params: dict[str, Any], rule: TurnRule | None) -> dict[str, Any]:
    """The segment's sampling params with the turn stops added to the sample's own stops."""
    if rule is None:
        return params
    own = params.get("stop") or []
    stops = [own] if isinstance(own, str) else list(own)
    stops += [s for s in rule.stop if s not in stops]
    ids = list(params.get("stop_token_ids") or [])
    ids += [t for t in rule.stop_token_ids if t not in ids]
    out = dict(params)
    if stops:
        out["stop"] = stops
    if ids:
        out["stop_token_ids"] = ids
    return out


def is_turn_stop(rule: TurnRule, matched: str | int | None) -> bool:
    if isinstance(matched, bool) or matched is None:
        return False
    if isinstance(matched, int):
        return matched in rule.stop_token_ids
    return matched in rule.stop


def turn_start(sample: Sample) -> int:
    """Where the turn in progress begins in `output_ids` (after the last ended turn)."""
    return sample.turns[-1].end if sample.turns else 0


def tokens_in_turn(sample: Sample) -> int:
    """Tokens the turn in progress has generated so far (0 at a turn boundary)."""
    return len(sample.output_ids) - turn_start(sample)


def end_of_segment(sample: Sample, matched: str | int | None, now: float | None = None) -> None:
    """After a segment was recorded (`samples.apply_segment`): end the turn if the segment
    ended it. A turn stop with budget and turns left makes the member await input; an episode
    that ended (completed, truncated) records its last turn. Mutates `sample`."""
    rule = sample.turn_rule
    if rule is None or sample.status not in ("completed", "truncated"):
        return
    now = time.time() if now is None else now
    reason: TurnEnd
    if sample.status == "completed" and is_turn_stop(rule, matched):
        number = len(sample.turns) + 1
        if rule.max_turns is not None and number >= rule.max_turns:
            sample.status, reason = "truncated", "max_turns"
        elif sample.max_new_tokens - len(sample.output_ids) <= 0:
            sample.status, reason = "truncated", "length"
        else:
            sample.status, reason = AWAITING, "turn_stop"
    elif sample.status == "completed":
        reason = "stop"
    else:
        reason = "length"
    start = turn_start(sample)
    if sample.turns and start == len(sample.output_ids) and reason == "length":
        return  # out of budget right at a boundary: the last turn is recorded already
    versions = [
        seg.weight_version
        for seg in sample.segments
        if seg.end > start and seg.start < len(sample.output_ids)
    ]
    sample.turns.append(
        Turn(
            start=start,
            end=len(sample.output_ids),
            stop=matched if reason in ("turn_stop", "max_turns", "stop") else None,
            end_reason=reason,
            weight_versions=list(dict.fromkeys(versions)),
            ended_at=now,
        )
    )


def check_answer(
    sample: Sample, ids: list[int], vocab_size: int | None, turn: int | None = None
) -> None:
    """Raise before anything changes: 409 `not_awaiting` (also when `turn`, if given, is not
    the turn it awaits an answer for), 400 for bad token ids."""
    if sample.status == AWAITING and turn is not None and turn != sample.turn:
        raise conflict(
            "not_awaiting",
            f"sample {sample.sample_id!r} awaits the answer of turn {sample.turn}, not {turn}",
        )
    if sample.status != AWAITING:
        raise conflict(
            "not_awaiting",
            f"sample {sample.sample_id!r} is {sample.status}, not awaiting input "
            "(an answer is taken once per turn)",
        )
    if not ids:
        raise bad_request("invalid_request", "the answer is empty")
    if vocab_size is not None and any(t < 0 or t >= vocab_size for t in ids):
        raise bad_request("invalid_token", f"append_ids must lie in [0, {vocab_size})")


def apply_answer(sample: Sample, ids: list[int], now: float | None = None) -> None:
    """Record the answer as appended context after the turn that ended, and make the member
    runnable again (`check_answer` and the context-length check have passed)."""
    now = time.time() if now is None else now
    sample.appended.append(Appended(at=len(sample.output_ids), ids=list(ids)))
    if sample.turns:
        last = sample.turns[-1]
        last.awaited_s = round(max(0.0, now - last.ended_at), 6)
    sample.status = "partial"
    sample.finish_reason = None


def awaiting(sample: Sample) -> bool:
    return sample.status == AWAITING
