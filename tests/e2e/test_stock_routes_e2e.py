"""Stock SGLang routes that other trainers drive (AReaL: `/abort_request`, `/pause_generation`
+ `/continue_generation`, `/update_weights_from_disk` with `abort_all_requests`, plain
`/generate`) arriving while an april call runs: no 5xx, the call answers, and every group it
held is returned or buffered with its partial output (tokens, logprobs, segments) intact."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from april_server.models import ensure_tiny_model
from tests.e2e.test_rollouts_e2e import R, clear_buffer, group
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
LONG = 3000  # tokens: still generating when the stock route arrives
SHORT = 1500  # tokens: meets the quota well before LONG, after the stock route arrived


@pytest.fixture()
def http(tiny_server: ServerProc) -> Iterator[httpx.Client]:
    with tiny_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def run_beside(
    c: httpx.Client,
    body: dict[str, Any],
    interrupt: Callable[[], None],
    path: str = R + "/rollouts",
) -> httpx.Response:
    """POST the april call (or resume: `path`) in a thread; once its samples run, call
    `interrupt`."""
    out: dict[str, httpx.Response] = {}

    def call() -> None:
        out["r"] = c.post(path, json=body)

    t = threading.Thread(target=call)
    t.start()
    deadline = time.monotonic() + 60
    while c.get(R + "/stats").json()["running_samples"] == 0:
        assert t.is_alive(), "the april call answered before it was seen generating"
        assert time.monotonic() < deadline, "the april call never started generating"
        time.sleep(0.05)
    time.sleep(0.3)  # some tokens first
    assert t.is_alive(), "the april call answered before the interruption"
    interrupt()
    t.join(timeout=300)
    assert not t.is_alive(), "the april call never answered"
    return out["r"]


def resumed_briefly(c: httpx.Client, sample_id: str) -> Any:
    """The sample as `/resume` answers once stopped after some tokens (its 3,000 would take
    seconds; a segment's version stamp is there from its first token)."""
    body = {"sample_ids": [sample_id]}
    stop = lambda: ok(c.post(R + "/abort", json={"all": True, "keep": "tokens"}))  # noqa: E731
    r = run_beside(c, body, stop, path=R + "/resume")
    assert r.status_code == 200, r.text
    return r.json()["samples"][0]


def check_consistent(c: httpx.Client, sent: list[str], resp: httpx.Response) -> list[Any]:
    """Every sent group returned or buffered, the buffered ones as resumable partials."""
    assert resp.status_code == 200, resp.text
    body = resp.json()
    returned = [g["group_id"] for g in body["groups"]]
    assert sorted(returned + body["buffered_group_ids"]) == sorted(sent)
    st = c.get(R + "/stats").json()
    assert st["running_samples"] == 0 and st["claimed_groups"] == 0
    listed = {g["group_id"]: g for g in c.get(R + "/partials").json()["groups"]}
    assert set(body["buffered_group_ids"]) <= set(listed)
    for gid in body["buffered_group_ids"]:
        for s in listed[gid]["samples"]:
            assert len(s["output_logprobs"]) == len(s["output_ids"]) <= s["max_new_tokens"]
            assert sum(x["end"] - x["start"] for x in s["segments"]) == len(s["output_ids"])
    return [listed[g] for g in body["buffered_group_ids"]]


def long_groups(prefix: str, k: int = 2) -> list[dict[str, Any]]:
    return [group(f"{prefix}{i}", [3 + i, 4, 5], [LONG, LONG], ignore_eos=True) for i in range(k)]


def test_stock_abort_all_leaves_partials(http: httpx.Client) -> None:
    groups = long_groups("ab")
    body = {"groups": groups, "target_groups": 2, "max_inflight_groups": 2}
    r = run_beside(http, body, lambda: ok(http.post("/abort_request", json={"abort_all": True})))
    assert r.json()["stats"]["quota_met"] is False
    buffered = check_consistent(http, [g["group_id"] for g in groups], r)
    assert len(buffered) == 2
    assert all(0 < len(s["output_ids"]) < LONG for g in buffered for s in g["samples"])
    # They resume like any partial (the next call finishes them from where they were).
    cont = http.post(R + "/resume", json={"sample_ids": ["ab0/0"], "kv": "recompute"})
    assert cont.status_code == 200 and len(cont.json()["samples"][0]["output_ids"]) == LONG


@pytest.mark.parametrize("mode", ["abort", "in_place", "retract"])
def test_pause_and_continue_generation(http: httpx.Client, mode: str) -> None:
    # The short group meets the quota, and is still running when the pause comes (with 40
    # tokens, the call had answered before the pause in all three modes on a quiet machine).
    short = group(f"p{mode}-short", [9, 9], [SHORT], ignore_eos=True)
    groups = [*long_groups(f"p{mode}"), short]
    body = {"groups": groups, "target_groups": 1, "max_inflight_groups": 3}

    def pause_then_continue() -> None:
        ok(http.post("/pause_generation", json={"mode": mode}))
        time.sleep(0.5)
        ok(http.post("/continue_generation", json={}))

    r = run_beside(http, body, pause_then_continue)
    check_consistent(http, [g["group_id"] for g in groups], r)
    if mode != "abort":  # paused in place or retracted: generation goes on afterwards
        assert r.json()["stats"]["quota_met"] is True


@pytest.mark.parametrize("attempt", range(3))  # SGLang's flush raced its abort about 1 in 2
def test_weight_reload_with_abort_all_requests(http: httpx.Client, attempt: int) -> None:
    before = http.get(R + "/stats").json()["weight_version"]
    groups = long_groups(f"w{attempt}-")
    body = {"groups": groups, "target_groups": 2, "max_inflight_groups": 2}
    new = f"{before}-areal{attempt}"

    def reload() -> None:
        req = {
            "model_path": str(ensure_tiny_model()),
            "weight_version": new,
            "abort_all_requests": True,
        }
        # A push with abort answers 200 and means it (#23 item 11): before, SGLang's flush
        # could come before its abort had emptied the batch and answer 400 though the
        # weights had changed, leaving /stats at the old version and outputs at the new.
        ok(http.post("/update_weights_from_disk", json=req))

    r = run_beside(http, body, reload)
    buffered = check_consistent(http, [g["group_id"] for g in groups], r)
    assert http.get(R + "/stats").json()["weight_version"] == new
    for g in buffered:  # what was generated before the reload carries the old version
        for s in g["samples"]:
            assert {seg["weight_version"] for seg in s["segments"]} == {before}
    # Continued afterwards, the new segment says which weights made it (SGLang's own stamp),
    # and that is the version /stats reports.
    s = resumed_briefly(http, f"w{attempt}-0/0")
    assert s["segments"][-1]["weight_version"] == new and len(s["segments"]) >= 2


def test_stock_generate_runs_beside_an_april_call(http: httpx.Client) -> None:
    groups = long_groups("g", 1) + [group("g-short", [7, 7], [SHORT], ignore_eos=True)]
    body = {"groups": groups, "target_groups": 1, "max_inflight_groups": 2}
    got: dict[str, Any] = {}

    def stock_generate() -> None:
        gen = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        got["gen"] = http.post("/generate", json=gen)

    r = run_beside(http, body, stock_generate)
    check_consistent(http, [g["group_id"] for g in groups], r)
    assert got["gen"].status_code == 200 and len(got["gen"].json()["output_ids"]) == 8


def ok(r: httpx.Response) -> None:
    assert r.status_code < 300, (r.status_code, r.text)
