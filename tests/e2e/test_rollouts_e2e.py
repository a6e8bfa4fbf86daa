"""End to end on CPU against the real SGLang scheduler (embedded tiny model, fp32)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
R = "/april/v1"
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture()
def http(tiny_server: ServerProc) -> httpx.Client:
    with tiny_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def clear_buffer(c: httpx.Client) -> None:
    for g in c.get(R + "/partials").json()["groups"]:
        assert c.delete(f"{R}/partials/{g['group_id']}").status_code == 200


def group(gid: str, prompt: list[int], budgets: list[int], **params: Any) -> dict[str, Any]:
    return {
        "group_id": gid,
        "input_ids": prompt,
        "n": len(budgets),
        "sampling_params": {**GREEDY, **params},
        "member_params": [{"max_new_tokens": b} for b in budgets],
    }


def ok(resp: httpx.Response) -> Any:
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_quota_partials_and_resume_first(http: httpx.Client) -> None:
    short = [group(f"s{i}", [5 + i, 9, 11], [12] * 4) for i in range(4)]
    long = [group(f"l{i}", [30 + i, 7], [12, 150 + 40 * i, 12, 60]) for i in range(4)]
    # All 8 groups at once (pinned: the shorts must run beside the longs to finish first).
    body = {"groups": long + short, "target_groups": 4, "max_inflight_groups": 8}
    r1 = ok(http.post(R + "/rollouts", json=body))
    assert len(r1["groups"]) == 4
    assert sorted(g["group_id"] for g in r1["groups"]) == ["s0", "s1", "s2", "s3"]
    assert all(s["status"] == "truncated" for g in r1["groups"] for s in g["samples"])
    listed = {g["group_id"]: g for g in ok(http.get(R + "/partials"))["groups"]}
    assert sorted(listed) == ["l0", "l1", "l2", "l3"] == sorted(r1["buffered_group_ids"])
    for g in listed.values():
        assert g["samples"][1]["status"] == "partial"
        assert len(g["samples"][1]["output_ids"]) > 0  # stragglers keep their tokens
        assert len(g["samples"][1]["output_logprobs"]) == len(g["samples"][1]["output_ids"])
    # A call with no new groups, served from the buffer, finishes them first.
    r2 = ok(http.post(R + "/rollouts", json={"groups": [], "target_groups": 4}))
    assert sorted(g["group_id"] for g in r2["groups"]) == ["l0", "l1", "l2", "l3"]
    for g in r2["groups"]:
        i = int(g["group_id"][1:])
        assert [len(s["output_ids"]) for s in g["samples"]] == [12, 150 + 40 * i, 12, 60]
        for s in g["samples"]:
            assert s["segments"][-1]["end"] == len(s["output_ids"])
            assert len(s["output_logprobs"]) == len(s["output_ids"])
    assert r2["stats"]["resumed_samples"] >= 4
    assert ok(http.get(R + "/partials"))["groups"] == []


def reference(http: httpx.Client, prompt: list[int], budget: int) -> tuple[list[int], list[Any]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {**GREEDY, "max_new_tokens": budget},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    out = ok(http.post("/generate", json=body))
    return out["output_ids"], out["meta_info"]["output_top_logprobs"]


def wait_until_idle(http: httpx.Client, timeout: float = 30.0) -> None:
    """Until no slot runs a sample (an earlier test's abort may still be winding down)."""
    deadline = time.monotonic() + timeout
    while True:
        slots = ok(http.get(R + "/stats"))["running_by_slot"]
        if all(x["running_samples"] == 0 for x in slots):
            return
        assert time.monotonic() < deadline, f"slots still running: {slots}"
        time.sleep(0.05)


def interrupted_on_the_second_slot(
    http: httpx.Client, prompt: list[int], budget: int
) -> dict[str, Any]:
    """Start a short trigger group, then `prompt` (so it takes the second slot: a DP rank or
    an engine), stop at the trigger's finish with a snapshot; the buffered sample `x/0`."""
    for _ in range(5):
        wait_until_idle(http)  # both slots idle: the trigger takes the lowest, x the other
        body = {
            "groups": [group("x-t", [1, 2], [8]), group("x", prompt, [budget])],
            "target_groups": 1,
            "on_quota": "snapshot",
            "max_inflight_groups": 2,
        }
        first = ok(http.post(R + "/rollouts", json=body))["groups"][0]
        if first["group_id"] == "x-t":
            sample: dict[str, Any] = ok(http.get(f"{R}/partials/x"))["samples"][0]
            ran = first["samples"][0]["segments"][0]
            # Its snapshot lives where its (only) segment ran.
            x_ran = sample["segments"][-1] if sample["segments"] else ran
            x_slot = (x_ran["engine"], x_ran["dp_rank"])
            if sample["snapshot_bytes"] > 0 and x_slot != (ran["engine"], ran["dp_rank"]):
                return sample
        # A scheduling race on 2 busy cores: the long one won, or the trigger finished
        # before x was placed (so x took the same, lowest slot). Again.
        clear_buffer(http)
    raise AssertionError("the trigger never finished first with x on the other slot")


NEAR_TIE = 1e-3  # fp32 re-prefill drift measured ~5e-7 (sglang-integration.md §10)


def assert_same_or_near_tie(got: list[int], want: list[int], top2: list[Any]) -> None:
    """Exact, or the first divergence is a genuine near-tie of the uninterrupted run."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a != b:
            (lp1, id1, *_), (lp2, id2, *_) = top2[i][:2]
            assert id1 == b and a == id2 and lp1 - lp2 < NEAR_TIE, (
                f"divergence at {i} is not a near-tie: got {a}, want {b}, top2 {top2[i]}"
            )
            return


@st.composite
def interruptions(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    budget = draw(st.integers(10, 160))
    cuts = draw(st.lists(st.integers(1, budget - 5), min_size=1, max_size=3, unique=True))
    prompt = draw(st.lists(st.integers(0, 300), min_size=1, max_size=6))
    return budget, sorted(cuts), prompt


@settings(
    max_examples=8,
    deadline=None,
    derandomize=True,  # seeded: a failure replays in CI
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=interruptions())
def test_greedy_interrupt_resume_equals_uninterrupted(
    http: httpx.Client, case: tuple[int, list[int], list[int]]
) -> None:
    """Interrupt at several points via the quota (a short group finishing first), resume by
    re-prefill, and compare with one uninterrupted run."""
    budget, cuts, prompt = case
    clear_buffer(http)
    want, top2 = reference(http, prompt, budget)
    body: dict[str, Any] = {  # tokens only: this is the re-prefill path (restore: test_kv_*)
        "groups": [group("x", prompt, [budget])],
        "target_groups": 1,
        "on_quota": "tokens",
        "max_inflight_groups": 16,  # x and its trigger run side by side
    }
    s: dict[str, Any] | None = None
    prev = 0
    for k, cut in enumerate(cuts):  # cuts are absolute positions; triggers run the increments
        body["groups"].append(group(f"trigger{k}", [1, 2], [cut - prev]))
        prev = cut
        r = ok(http.post(R + "/rollouts", json=body))
        http.delete(f"{R}/partials/trigger{k}")
        body = {"groups": [], "target_groups": 1, "on_quota": "tokens", "max_inflight_groups": 16}
        if r["groups"][0]["group_id"] == "x":  # x won the race: it is finished, stop cutting
            s = r["groups"][0]["samples"][0]
            break
    if s is None:
        s = ok(http.get(R + "/partials/x"))["samples"][0]
    if s["status"] == "partial":  # else x finished in the same call, after its trigger
        out = ok(http.post(R + "/resume", json={"sample_ids": ["x/0"], "kv": "recompute"}))
        s = out["samples"][0]
    assert s["segments"][0]["kv"] == "fresh"
    assert all(seg["kv"] == "recomputed" for seg in s["segments"][1:])
    assert_same_or_near_tie(s["output_ids"], want, top2)
    clear_buffer(http)


def test_abort_waits_for_idle_and_is_idempotent(http: httpx.Client) -> None:
    result: dict[str, Any] = {}

    def call() -> None:
        body = {"groups": [group("slow", [4, 4], [3000, 3000])], "target_groups": 1}
        result["r"] = http.post(R + "/rollouts", json=body).json()

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 60
    while ok(http.get(R + "/stats"))["running_samples"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    first = ok(http.post(R + "/abort", json={"all": True}))
    assert {s["sample_id"] for s in first["samples"]} == {"slow/0", "slow/1"}
    loads = ok(http.get("/v1/loads"))
    assert sum(x.get("num_reqs", 0) for x in loads.get("loads", [loads])) == 0, loads
    assert ok(http.get(R + "/stats"))["running_samples"] == 0
    second = ok(http.post(R + "/abort", json={"all": True}))
    assert second["samples"] == []
    t.join(60)
    r = result["r"]
    assert r["groups"] == [] and r["stats"]["quota_met"] is False
    kept = ok(http.get(R + "/partials/slow"))["samples"]
    assert all(0 < len(s["output_ids"]) < 3000 for s in kept)


BAD: list[tuple[str, str, Any, int]] = [
    ("post", "/rollouts", b"{not json", 400),
    ("post", "/rollouts", {"groups": "x"}, 422),
    ("post", "/rollouts", {"groups": [{"group_id": "a", "input_ids": [1], "n": "2"}]}, 422),
    ("post", "/rollouts", {"groups": [{"group_id": "a", "input_ids": [1], "n": 0}]}, 400),
    ("post", "/rollouts", {"groups": [{"group_id": "a", "input_ids": []}]}, 400),
    ("post", "/rollouts", {"groups": [group("a", [1], [-1])]}, 400),
    ("post", "/rollouts", {"groups": [group("a", [1], [10**6])]}, 400),
    ("post", "/rollouts", {"groups": [group("a", [1], [3])], "target_groups": 2}, 400),
    ("post", "/rollouts", {"groups": [group("a", [1], [3]), group("a", [1], [3])]}, 400),
    ("post", "/rollouts", {"groups": [group("a", [1], [3])], "bogus": 1}, 422),
    ("post", "/rollouts", {"groups": [group("a", [1], [3], top_p=7.0)]}, 400),
    ("post", "/rollouts", {"groups": [group("a", [10**7], [3])]}, 400),
    # Refused as sent to SGLang, not as written (review of 2026-12-06: each was a 200, then
    # every segment failed and the group never finished): a floor over a member's budget,
    # more stop strings than SGLang takes with the turn stops added, a seed past int64.
    ("post", "/rollouts", {"groups": [group("a", [1], [3], min_new_tokens=8)]}, 400),
    (
        "post",
        "/rollouts",
        {
            "groups": [group("a", [1], [3], stop=[f"s{i}" for i in range(20)])],
            "turns": {"stop": [f"t{i}" for i in range(20)]},
        },
        400,
    ),
    ("post", "/rollouts", {"groups": [{**group("a", [1], [3, 3]), "seed": 2**63 - 1}]}, 400),
    ("post", "/resume", {"sample_ids": ["nope/0"]}, 404),
    ("post", "/resume", {"sample_ids": "x"}, 422),
    ("post", "/abort", {"sample_ids": ["nope/0"]}, 404),
    ("post", "/abort", {"keep": "everything"}, 422),
    ("get", "/partials/nope", None, 404),
    ("delete", "/partials/nope", None, 404),
    ("post", "/rollouts/nope/reject", {"group_ids": ["a"]}, 404),
]


@pytest.mark.parametrize(("method", "path", "body", "status"), BAD)
def test_bad_input_gets_contract_error(
    http: httpx.Client, method: str, path: str, body: Any, status: int
) -> None:
    kw: dict[str, Any] = {}
    if isinstance(body, bytes):
        kw["content"] = body
    elif body is not None:
        kw["json"] = body
    r = http.request(method.upper(), R + path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"code", "message"} and err["code"] and err["message"]
    assert ok(http.get(R + "/partials"))["groups"] == []  # bad input changes nothing


def test_dropped_stream_keeps_stragglers_and_leaks_nothing(http: httpx.Client) -> None:
    body = {
        "groups": [group("fast", [3], [2]), group("slow", [4], [3000, 3000])],
        "target_groups": 2,
        "max_inflight_groups": 2,
        "stream": True,
        "on_quota": "snapshot",
    }
    with http.stream("POST", R + "/rollouts", json=body) as r:
        for line in r.iter_lines():
            if line:  # the first group_finished event: then the client goes away
                break
    deadline = time.monotonic() + 30
    while ok(http.get(R + "/stats"))["active_calls"] and time.monotonic() < deadline:
        time.sleep(0.1)
    st = ok(http.get(R + "/stats"))
    assert st["active_calls"] == 0 and st["running_samples"] == 0
    kept = {g["group_id"]: g for g in ok(http.get(R + "/partials"))["groups"]}
    assert set(kept) == {"fast", "slow"}  # nothing acknowledged: everything kept
    assert all(0 < len(s["output_ids"]) < 3000 for s in kept["slow"]["samples"])
    live = sum(s["snapshot_bytes"] for g in kept.values() for s in g["samples"])
    assert st["snapshot_bytes_used"] == live


def test_typed_client_against_the_real_server(http: httpx.Client, tiny_server: ServerProc) -> None:
    from april_client import AprilClient, AsyncAprilClient, NotFound

    with AprilClient(tiny_server.url) as c:
        r = c.rollout([group("ca", [3], [4]), group("cb", [5], [300])], 1, on_quota="tokens")
        assert [g.group_id for g in r.groups] == ["ca"] and r.buffered_group_ids == ["cb"]
        assert [g.group_id for g in c.partials()] == ["cb"]
        out = c.resume(["cb/0"])
        assert len(out.samples[0].output_ids) == 300
        with pytest.raises(NotFound):
            c.partial("nope")
        assert c.delete_partial("cb").deleted

    async def go() -> None:
        async with AsyncAprilClient(tiny_server.url) as c:
            events = [e async for e in c.rollout_stream([group("cs", [2], [3])], 1)]
            assert [type(e).__name__ for e in events] == ["GroupFinishedEvent", "DoneEvent"]

    asyncio.run(go())


def test_length_prediction_orders_a_call_and_is_scored(http: httpx.Client) -> None:
    """#35 on the real engine: a prompt's earlier rollouts predict its next ones; a call with
    `length_order: longest_first` starts the predicted-longest new group first; the prediction
    is shown and scored."""

    def lp() -> dict[str, Any]:
        figures: dict[str, Any] = ok(http.get(R + "/stats"))["length_prediction"]
        return figures

    short, long = [71, 72, 73], [81, 82, 83]
    epoch1 = [group("lp-s1", short, [6, 6]), group("lp-l1", long, [40, 40])]
    ok(http.post(R + "/rollouts", json={"groups": epoch1, "target_groups": 2}))
    before = lp()
    # One group at a time, quota 1: the order decides which group runs at all.
    for order, runs in (("arrival", "lp-s2"), ("longest_first", "lp-l3")):
        tag = runs[-1]
        sent = [group(f"lp-s{tag}", short, [6, 6]), group(f"lp-l{tag}", long, [40, 40])]
        body = {
            "groups": sent,
            "target_groups": 1,
            "max_inflight_groups": 1,
            "length_order": order,
            "resume_first": False,
        }
        got = ok(http.post(R + "/rollouts", json=body))["groups"]
        assert [g["group_id"] for g in got] == [runs], order
        for s in got[0]["samples"]:
            assert s["predicted_tokens"] == len(s["output_ids"]) and s["predicted_remaining"] == 0
    after = lp()
    assert after["scored_samples"] - before["scored_samples"] == 4
    assert after["abs_error_tokens"] == before["abs_error_tokens"]  # exact: the budgets bind
    idle = {g["group_id"]: g for g in ok(http.get(R + "/partials"))["groups"]}
    assert set(idle) == {"lp-l2", "lp-s3"}  # never started: what each order left behind
    for s in idle["lp-s3"]["samples"]:
        assert (s["predicted_tokens"], s["predicted_remaining"]) == (6, 6)
    assert "april_length_predictions_scored_total" in http.get("/metrics").text
    forgotten = ok(http.delete(R + "/lengths"))["forgotten_prompts"]
    assert forgotten >= 2 and lp()["history_prompts"] == 0
