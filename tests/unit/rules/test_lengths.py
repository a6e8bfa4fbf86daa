"""Predicted lengths (#35): the rule, the history, the score, the order; then through the routes
over a fake engine (what a call starts first, what /partials, /stats and /metrics show)."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from april_server.rules.lengths import (
    LengthHistory,
    LengthModel,
    PredictionScore,
    predict,
    prompt_key,
)
from tests.unit.http.test_app import R, _client, app_and_manager


def test_no_evidence_no_prediction() -> None:
    assert predict(0, 100, [], []) is None


def test_siblings_count_twice_and_the_median_is_taken() -> None:
    p = predict(0, 100, siblings=[10], history=[50, 60])
    assert p is not None and p.basis == "both"
    assert p.total == 10  # weights 2 (sibling) vs 1 + 1: the sibling is the median
    p = predict(0, 100, siblings=[], history=[10, 50, 60])
    assert p is not None and (p.total, p.remaining, p.basis) == (50, 50, "history")


def test_a_sample_past_the_short_ones_is_predicted_from_the_longer_ones() -> None:
    p = predict(30, 100, siblings=[10, 20, 80], history=[])
    assert p is not None and (p.total, p.remaining) == (80, 50)
    p = predict(90, 100, siblings=[10, 20, 80], history=[])
    assert p is not None and (p.total, p.basis) == (100, "outlived")
    assert p.remaining == 10 and p.confidence < 0.5


def test_agreement_and_evidence_raise_confidence() -> None:
    tight = predict(0, 500, [100, 101, 99], [])
    loose = predict(0, 500, [10, 100, 400], [])
    few = predict(0, 500, [100], [])
    assert tight and loose and few
    assert tight.confidence > loose.confidence
    assert tight.confidence > few.confidence


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(1, 300),
    st.lists(st.integers(0, 400), max_size=6),
    st.lists(st.integers(0, 400), max_size=6),
)
def test_a_prediction_is_always_a_length_it_can_still_reach(
    generated: int, budget: int, siblings: list[int], history: list[int]
) -> None:
    p = predict(generated, budget, siblings, history)
    if not siblings and not history:
        assert p is None
        return
    assert p is not None
    assert generated < p.total <= max(budget, generated + 1)
    assert p.remaining == p.total - generated >= 1
    assert 0.0 <= p.confidence <= 1.0


def _brute_force(generated: int, budget: int, sib: list[int], hist: list[int]) -> Any:
    """The rule written out plainly: weighted median, mean and spread of the longer ones."""
    obs = [(x, 2.0) for x in sib] + [(x, 1.0) for x in hist]
    longer = sorted((x, w) for x, w in obs if x > generated)
    if not obs or not longer:
        return None if not obs else max(budget, generated + 1)
    half, acc, median = sum(w for _, w in longer) / 2, 0.0, longer[-1][0]
    for x, w in longer:
        acc += w
        if acc >= half:
            median = x
            break
    return min(max(median, generated + 1), max(budget, generated + 1))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(0, 300),
    st.integers(1, 300),
    st.lists(st.integers(0, 400), max_size=8),
    st.lists(st.integers(0, 400), max_size=8),
)
def test_the_fast_rule_equals_the_plain_one(
    generated: int, budget: int, siblings: list[int], history: list[int]
) -> None:
    p = predict(generated, budget, siblings, history)
    want = _brute_force(generated, budget, siblings, history)
    assert (p.total if p is not None else None) == want


def test_history_keeps_the_newest_per_prompt_and_forgets_the_least_recent_prompt() -> None:
    h = LengthHistory(per_prompt=3, max_prompts=2)
    for x in (1, 2, 3, 4):
        h.add("a", x)
    h.add("b", 9)
    h.add("a", 5)  # "a" seen last: "b" is now the least recent
    h.add("c", 7)
    assert list(h.get("a")) == [3, 4, 5] and h.get("b") == () and list(h.get("c")) == [7]
    assert sorted(k for k, _ in h.take_dirty()) == ["a", "c"]
    assert h.take_dirty() == []
    again = LengthHistory()
    again.load([("a", [3, 4, 5]), ("c", [7])])
    assert list(again.get("a")) == [3, 4, 5] and again.dirty == set()


def test_prompt_key_is_the_tokens() -> None:
    assert prompt_key([1, 2, 3]) == prompt_key([1, 2, 3]) != prompt_key([1, 2, 4])
    assert prompt_key([1 << 40]) != prompt_key([0])


def test_score_sums_and_means() -> None:
    s = PredictionScore()
    s.add(10, 20)
    s.add(30, 20)
    f = s.figures()
    assert (f["scored_samples"], f["abs_error_tokens"], f["error_tokens"]) == (2, 20, 0)
    assert f["mean_abs_error_tokens"] == 10.0 and f["mean_abs_rel_error"] == 0.5


def _g(gid: str, budgets: list[int], prompt: list[int]) -> dict[str, Any]:
    return {
        "group_id": gid,
        "input_ids": prompt,
        "n": len(budgets),
        "sampling_params": {"ignore_eos": True},
        "member_params": [{"max_new_tokens": b} for b in budgets],
    }


SHORT, LONG = [1, 2, 3], [4, 5, 6]


def _first_started(mgr: Any, calls_before: int) -> list[list[int]]:
    """The prompts of the requests the engine got since `calls_before`, in order."""
    return [ids[:3] for _, ids, _ in mgr.engine.calls[calls_before:]]


def test_a_call_starts_the_predicted_longest_first_and_reports_the_error() -> None:
    async def go() -> None:
        app, mgr = app_and_manager()
        async with await _client(app) as c:
            # Epoch 1: each prompt once (no evidence yet: started as sent).
            body = {"groups": [_g("s1", [4, 4], SHORT), _g("l1", [40, 40], LONG)]}
            r = await c.post(R + "/rollouts", json={**body, "target_groups": 2})
            assert r.status_code == 200, r.text
            stats = (await c.get(R + "/stats")).json()["length_prediction"]
            assert stats["history_prompts"] == 2 and stats["scored_samples"] == 0
            # Epoch 2, one group at a time: sent short first, the long one starts first.
            for order, first in (("arrival", SHORT), ("longest_first", LONG)):
                before = len(mgr.engine.calls)
                req = {
                    "groups": [_g(f"s-{order}", [4, 4], SHORT), _g(f"l-{order}", [40, 40], LONG)],
                    "target_groups": 2,
                    "max_inflight_groups": 1,
                    "length_order": order,
                }
                r = await c.post(R + "/rollouts", json=req)
                assert r.status_code == 200, r.text
                assert _first_started(mgr, before)[0] == first, order
                s0 = r.json()["groups"][0]["samples"][0]
                assert s0["predicted_remaining"] == 0 and s0["predicted_tokens"] in (4, 40)
            stats = (await c.get(R + "/stats")).json()["length_prediction"]
            assert stats["scored_samples"] == 8 and stats["mean_abs_error_tokens"] == 0.0
            metrics = (await c.get(R + "/metrics")).text
            assert "april_length_predictions_scored_total 8.0" in metrics
            # A buffered group shows what it would start under now.
            req = {"groups": [_g("s3", [4, 4], SHORT), _g("l3", [40, 40], LONG)]}
            r = await c.post(R + "/rollouts", json={**req, "target_groups": 1})
            assert r.status_code == 200, r.text
            page = (await c.get(R + "/partials")).json()["groups"]
            assert [g["group_id"] for g in page] == ["l3"]
            for s in page[0]["samples"]:
                assert s["predicted_tokens"] == 40 and s["prediction_confidence"] > 0.5
                assert s["predicted_remaining"] == 40 - len(s["output_ids"])
            advisor = mgr.sizing.advisor
            r = await c.delete(R + "/lengths")
            assert r.status_code == 200 and r.json() == {"forgotten_prompts": 2}
            assert advisor.version is None and not advisor.targets and not advisor.pushes
            assert (await c.get(R + "/stats")).json()["length_prediction"]["history_prompts"] == 0

    asyncio.run(go())


def test_an_unknown_length_order_is_refused() -> None:
    async def go() -> None:
        app, _ = app_and_manager()
        async with await _client(app) as c:
            req = {"groups": [_g("a", [2], SHORT)], "length_order": "random"}
            r = await c.post(R + "/rollouts", json=req)
            assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_schema"

    asyncio.run(go())


def test_model_order_is_stable_and_unknown_counts_as_the_mean_finished_length() -> None:
    from april_client.protocol import GroupSpec
    from april_server.rules.samples import build_group

    def grp(gid: str, prompt: list[int], budget: int) -> Any:
        spec = GroupSpec(
            group_id=gid, input_ids=prompt, n=1, sampling_params={"max_new_tokens": budget}
        )
        return build_group(spec, prompt, 512, None)

    m = LengthModel()
    gs = [grp("a", [1], 100), grp("b", [2], 100), grp("c", [3], 50), grp("d", [1], 100)]
    # Nothing seen yet: every group alike, arrival order whatever the budgets say.
    assert [g.group_id for g in m.order(gs, "longest_first")] == ["a", "b", "c", "d"]
    for key, length in (([1], 10), ([2], 90), ([9], 20)):  # the mean finished length: 40
        done = grp("x", key, 100).samples[0]
        done.status, done.output_ids = "completed", [5] * length
        m.finished(done)
    assert m.prior == 40.0
    assert [g.group_id for g in m.order(gs, "arrival")] == ["a", "b", "c", "d"]
    assert [g.group_id for g in m.order(gs, "longest_first")] == ["b", "c", "a", "d"]
    assert [g.group_id for g in m.order(gs, "shortest_first")] == ["a", "d", "c", "b"]
    # New prompts (no history, nothing finished): alike whatever their budgets, as sent.
    fresh = [grp("e", [7], 10), grp("f", [8], 500), grp("g", [6], 50)]
    assert [g.group_id for g in m.order(fresh, "longest_first")] == ["e", "f", "g"]
    # What a call plays forward (rules/pool_size.py): each open member's predicted remaining
    # (prompt [1] ran 10 before: 10 left; no evidence: the prior of 40), and the lengths
    # seen to finish, in order, until the history is forgotten.
    a = gs[0].samples[0]
    assert m.remaining(gs[0]) == [10.0] and m.remaining(fresh[0]) == [40.0]
    a.output_ids = [5] * 4
    assert m.remaining(gs[0]) == [10.0 - 4]
    a.output_ids = [5] * 12
    assert m.remaining(gs[0]) == [100.0 - 12]  # outlived its one observation: at its budget
    assert list(m.recent) == [10, 90, 20]
    m.forget()
    assert list(m.recent) == [] and m.prior == 40.0


def test_the_history_survives_a_restart_in_the_store(tmp_path: Any) -> None:
    from april_server.buffer.store import BufferStore

    path = tmp_path / "buffer.sqlite"
    store = BufferStore(path)
    h = LengthHistory()
    h.add("a", 5)
    h.add("b", 9)
    store.save_lengths(h.take_dirty())
    h.add("a", 7)
    store.save_lengths(h.take_dirty())  # "a" again: replaced, and now the most recent
    store.close()
    again = BufferStore(path)
    assert again.load_lengths() == [("b", [9]), ("a", [5, 7])]
    again.save_lengths([], forget=True)
    assert again.load_lengths() == []
    again.close()


def test_the_stored_history_is_bounded_like_the_one_in_memory(tmp_path: Any) -> None:
    """Found by review: the table kept one row for every prompt ever seen (memory forgets the
    least recently seen past `max_prompts`; the file did not). Pruned every
    `LENGTHS_PRUNE_EVERY` saves to the newest `max_prompts`."""
    from april_server.buffer.store import LENGTHS_PRUNE_EVERY, BufferStore

    store = BufferStore(tmp_path / "buffer.sqlite")
    store.max_prompts = 5
    for i in range(LENGTHS_PRUNE_EVERY):
        store.save_lengths([(f"p{i}", [i])])
    rows = store.load_lengths()  # the writes queue on the store's thread before this read
    assert [k for k, _ in rows] == [
        f"p{i}" for i in range(LENGTHS_PRUNE_EVERY - 5, LENGTHS_PRUNE_EVERY)
    ]
    store.close()


def test_the_history_is_loaded_at_start_up_not_on_the_first_request(tmp_path: Any) -> None:
    """Found by review: the manager (built on the first request, on the event loop every
    request shares) read and replayed the whole stored history there."""
    from april_server.buffer.store import BufferStore
    from april_server.engine.weight_session import WeightSession
    from april_server.root.holder import RootHolder
    from april_server.settings.config import AprilConfig

    store = BufferStore(tmp_path / "buffer.sqlite")
    store.save_lengths([("a", [5, 7]), ("b", [9])])
    store.close()

    def no_engine() -> Any:
        raise AssertionError("not built at start-up")

    holder = RootHolder(AprilConfig(state_dir=tmp_path), no_engine, WeightSession())
    lengths = holder.durable.lengths
    assert list(lengths.get("a")) == [5, 7] and len(lengths) == 2
    holder.durable.store.close()
