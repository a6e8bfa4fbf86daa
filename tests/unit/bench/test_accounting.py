"""april-bench's sample accounting: a sound run passes, every kind of loss or duplication is
reported, and modes that consume different numbers of samples per step are flagged."""

from __future__ import annotations

from april_bench.accounting import Consumed, Ledger, compare_modes


def consumed(gid: str, budgets: tuple[int, ...], tokens: list[int] | None = None) -> list[Consumed]:
    toks = tokens if tokens is not None else list(budgets)
    return [Consumed(f"{gid}/{j}", gid, j, toks[j], "truncated") for j in range(len(budgets))]


def ledger(mode: str = "april") -> Ledger:
    led = Ledger(mode, groups_per_step=2, n=2)
    for i in range(6):
        led.send(f"g{i}", i, (3, 5))
    return led


def test_a_sound_april_run_passes() -> None:
    led = ledger()
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5)))
    led.consume(1, consumed("g0", (3, 5)) + consumed("g4", (3, 5)))
    led.set_leftover({"g2": 4, "g5": 0})
    assert led.check() == []
    assert led.samples_per_step() == [4, 4]
    assert led.consumed_tokens() == 32


def test_a_group_consumed_twice_is_reported() -> None:
    led = ledger()
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5)))
    led.consume(1, consumed("g1", (3, 5)) + consumed("g4", (3, 5)))
    led.set_leftover({"g0": 0, "g2": 0, "g5": 0})
    problems = led.check()
    assert any("g1/0 consumed twice" in p for p in problems)


def test_a_group_neither_consumed_nor_buffered_is_lost() -> None:
    led = ledger()
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5)))
    led.set_leftover({"g0": 0, "g2": 0, "g4": 0})  # g5 vanished
    assert any("lost" in p and "g5" in p for p in led.check())


def test_consumed_and_still_buffered_is_a_duplicate() -> None:
    led = ledger()
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5)))
    led.set_leftover({"g0": 0, "g1": 0, "g2": 0, "g4": 0, "g5": 0})
    assert any("both consumed and still buffered" in p for p in led.check())


def test_short_step_missing_member_and_wrong_budget_are_reported() -> None:
    led = ledger()
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5))[:1])
    led.consume(1, consumed("g0", (3, 5), tokens=[3, 4]) + consumed("g2", (3, 5)))
    led.set_leftover({"g4": 0, "g5": 0})
    problems = "\n".join(led.check())
    assert "step 0: consumed 3 samples" in problems
    assert "group g3 consumed with members [0]" in problems
    assert "g0/1: 4 tokens, budget 5" in problems


def test_unfinished_or_unsent_samples_are_reported() -> None:
    led = ledger()
    partial = [Consumed("g1/0", "g1", 0, 3, "partial"), Consumed("g1/1", "g1", 1, 5, "truncated")]
    led.consume(0, partial + consumed("zz", (3, 5)))
    problems = "\n".join(led.check())
    assert "g1/0 consumed while partial" in problems
    assert "zz/0 was never sent" in problems


def test_natural_lengths_only_need_to_stay_within_budget() -> None:
    led = Ledger("sync", groups_per_step=1, n=2, exact_budgets=False)
    led.send("g0", 0, (8, 8))
    led.consume(0, consumed("g0", (8, 8), tokens=[2, 8]))
    assert led.check() == []
    led.consume(1, consumed("g1", (8, 8), tokens=[9, 1]))
    assert any("never sent" in p for p in led.check())


def test_modes_must_consume_the_same_samples_per_step() -> None:
    a, b = ledger("sync"), ledger("april")
    a.consume(0, consumed("g0", (3, 5)) + consumed("g1", (3, 5)))
    b.consume(0, consumed("g2", (3, 5)) + consumed("g3", (3, 5)))
    assert compare_modes([a, b]) == []
    b.consume(1, consumed("g4", (3, 5)))
    assert compare_modes([a, b]) != []


def test_outstanding_groups_are_sent_and_neither_consumed_nor_dropped() -> None:
    """What april-async's prefetch sizes the next hand-in from."""
    led = ledger()
    assert led.outstanding() == {f"g{i}" for i in range(6)}
    led.consume(0, consumed("g1", (3, 5)) + consumed("g3", (3, 5)))
    led.dropped.add("g5")
    assert led.outstanding() == {"g0", "g2", "g4"}
    led.send("g6", 6, (3, 5))  # a hand-in for the next step
    assert led.outstanding() == {"g0", "g2", "g4", "g6"}
