"""The chaos client's ledger (tests/chaos/ledger.py): what counts as lost, twice,
unknown or incomplete."""

from __future__ import annotations

from typing import Any

from tests.chaos.ledger import ChaosLedger, whole


def sample(sid: str, n: int, status: str = "completed") -> dict[str, Any]:
    return {
        "sample_id": sid,
        "output_ids": [1] * n,
        "output_logprobs": [0.0] * n,
        "segments": [{"start": 0, "end": n}],
        "status": status,
    }


def group(gid: str, n: int = 3) -> dict[str, Any]:
    return {"group_id": gid, "samples": [sample(f"{gid}/0", n)]}


def test_every_acknowledged_group_is_delivered_once_or_gone() -> None:
    led = ChaosLedger()
    led.sent(["a", "b", "c"], acknowledged=True)
    led.sent(["m"], acknowledged=False)  # an abandoned call's, fate unknown
    led.answered("r1", {"batch_id": "b1", "groups": [group("a")], "dropped_group_ids": ["b"]})
    led.answered("r1", {"batch_id": "b1", "groups": [group("a")]})  # a retry: the same answer
    assert led.check(0, 0) == ["1 acknowledged groups unaccounted for: c: sent by a call"]
    led.gone.add("c")
    assert led.check(0, 0) == []
    led.answered("r2", {"batch_id": "b2", "groups": [group("m")]})  # it did exist: fine
    assert led.check(0, 0) == []


def test_twice_unknown_and_leftovers_are_failures() -> None:
    led = ChaosLedger()
    led.sent(["a"], acknowledged=True)
    led.answered("r1", {"batch_id": "b1", "groups": [group("a")]})
    led.answered("r2", {"batch_id": "b2", "groups": [group("a"), group("z")]})
    bad = led.check(2, 100)
    assert any("more than once" in b for b in bad) and any("never sent" in b for b in bad)
    assert any("still buffered" in b for b in bad) and any("snapshot bytes" in b for b in bad)


def test_a_reused_id_may_be_delivered_twice() -> None:
    led = ChaosLedger()
    led.sent(["a"], acknowledged=True)
    led.answered(None, {"batch_id": "b1", "groups": [group("a")]})
    led.reused.add("a")
    led.answered(None, {"batch_id": "b2", "groups": [group("a")]})
    assert led.check(0, 0) == []


def test_5xx_is_a_failure_but_no_engine_is_counted_apart() -> None:
    led = ChaosLedger()
    led.status("x", 503, '{"error": {"code": "no_engine"}}')
    assert led.no_engine == 1 and led.check(0, 0) == []
    led.status("x", 500, "boom")
    assert led.check(0, 0) == ["x: HTTP 500 boom"]


def test_a_delivered_sample_must_be_whole() -> None:
    bad = sample("g/0", 3)
    bad["output_logprobs"] = [0.0]
    bad["segments"] = [{"start": 0, "end": 2}]
    assert whole({"group_id": "g", "samples": [bad]}) == [
        "g/0: 3 tokens, 1 logprobs",
        "g/0: segments cover 2 of 3 tokens",
    ]
    assert whole({"group_id": "g", "samples": [sample("g/0", 2, "partial")]}) == [
        "g/0: delivered as partial"
    ]


def test_an_input_404_counts_only_while_the_group_is_there_and_leftovers_fail() -> None:
    led = ChaosLedger()
    led.answer_refused("g/0", 404, group_there=False)  # delivered or deleted meanwhile: fine
    led.answer_refused("g/0", 409, group_there=True)
    assert led.check(0, 0) == []
    led.answer_refused("g/0", 404, group_there=True)
    assert led.check(0, 0) == ["input 404 for g/0, announced awaiting, group on server"]
    left = {"awaiting_input_samples": 2, "running_samples": 0}
    assert ChaosLedger().check(0, 0, left) == ["2 awaiting_input_samples after the drain"]


def test_a_turn_stop_inside_a_delivered_turn_is_a_failure() -> None:
    s = sample("g/0", 6)
    s["output_ids"] = [4, 9, 5, 6, 7, 9]
    s["turn_rule"] = {"stop_token_ids": [9]}
    s["turns"] = [{"start": 0, "end": 2}, {"start": 2, "end": 6}]
    assert whole({"group_id": "g", "samples": [s]}) == []
    s["turns"] = [{"start": 0, "end": 6}]  # the first turn's stop merged into one turn
    (bad,) = whole({"group_id": "g", "samples": [s]})
    assert "a turn stop at 1 inside turn" in bad
