"""`max_inflight_groups: "auto"` on the real SGLang scheduler: the server never runs more than it
was sent nor more than its own running target, and SGLang's running batch agrees."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest

from tests.e2e.test_rollouts_e2e import R, clear_buffer, group, ok
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e


class RunningPeak:
    """Polls SGLang's own `/v1/loads` in a thread and keeps the largest running batch seen."""

    def __init__(self, url: str) -> None:
        self.url, self.peak, self.polls = url, 0, 0
        self.stop, self.first_poll = threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            while not self.stop.is_set():
                loads = c.get("/v1/loads").json().get("loads", [])
                self.peak = max(self.peak, sum(int(x.get("num_running_reqs", 0)) for x in loads))
                self.polls += 1
                self.first_poll.set()
                self.stop.wait(0.005)

    def __enter__(self) -> RunningPeak:
        self.thread.start()
        # A short rollout could finish before the thread's first answer: wait for it, so that
        # `polls > 0` means we watched the whole call.
        self.first_poll.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def heavy_tail(prefix: str, count: int, n: int = 4) -> list[dict[str, Any]]:
    """Mostly short members, one long one per group: the APRIL shape."""
    return [
        group(f"{prefix}{i}", [3 + i, 17, 29], [6 + 4 * j for j in range(n - 1)] + [120 + 10 * i])
        for i in range(count)
    ]


def warm_step_curve(c: httpx.Client) -> None:
    """Concurrent requests of staggered lengths: the running batch drains 24 -> 1, so the
    scheduler times decode steps at many batch sizes (the policy's measured curve)."""
    ids = [[5, 6, i] for i in range(24)]
    params = [
        {"max_new_tokens": 8 + 4 * i, "ignore_eos": True, "temperature": 0.0} for i in range(24)
    ]
    ok(c.post("/generate", json={"input_ids": ids, "sampling_params": params}))


@pytest.fixture()
def http(tiny_server: ServerProc) -> httpx.Client:
    with tiny_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def test_auto_never_runs_more_than_sent_or_its_target(
    http: httpx.Client, tiny_server: ServerProc
) -> None:
    warm_step_curve(http)
    policy = ok(http.get(R + "/stats"))["inflight_policy"]
    sent_total = 0
    for step, count in enumerate([12, 6, 3]):
        groups = heavy_tail(f"s{step}g", count)
        buffered = len(ok(http.get(R + "/partials"))["groups"])
        sent_total += count
        body = {"groups": groups, "target_groups": 2, "resume_first": True}  # auto: the default
        with RunningPeak(tiny_server.url) as seen:
            r = ok(http.post(R + "/rollouts", json=body))
        st = r["stats"]
        target = st["inflight_target"]
        assert target is not None and target >= 2 * 4  # never below what the quota needs
        assert st["num_started_groups"] <= count + buffered  # never more groups than it has
        assert st["peak_running_samples"] <= min(target, 4 * (count + buffered))
        # The advice for the next call: at least the quota and all this call buffered, at
        # most 4 x the quota unless it carries more (rules/pool_size.py).
        wanted, kept = st["groups_wanted"], st["num_buffered_groups"]
        assert wanted is not None and max(2, kept) <= wanted <= max(4 * 2, kept), (wanted, kept)
        assert seen.polls > 0 and seen.peak <= target, (seen.peak, target)
        assert len(r["groups"]) == 2
        policy = ok(http.get(R + "/stats"))["inflight_policy"]
        assert policy["last_target"] == target and policy["reason"]
    # Every group sent is somewhere: returned, or still buffered; nothing was lost or doubled.
    left = {g["group_id"] for g in ok(http.get(R + "/partials"))["groups"]}
    assert len(left) == sent_total - 3 * 2
    assert len(policy["step_time_s_by_batch"]) >= 3  # the curve was measured, not the prior
    measured = policy["measured_by_batch"]  # what the scheduler measured, with its spread
    assert set(measured) == set(policy["step_time_s_by_batch"])
    assert all(n >= 3 and mean > 0 and std >= 0 for n, mean, std, _ in measured.values())
    # The steps' attended context is read from SGLang's batch (else the policy is blind to it).
    assert all(context > 0 for *_, context in measured.values())
    assert policy["context_per_sample"] > 0 and policy["context_cost_s_per_token"] is not None


def test_pinned_integer_caps_the_running_batch(http: httpx.Client, tiny_server: ServerProc) -> None:
    body = {"groups": heavy_tail("p", 8), "target_groups": 2, "max_inflight_groups": 3}
    with RunningPeak(tiny_server.url) as seen:
        r = ok(http.post(R + "/rollouts", json=body))
    assert r["stats"]["inflight_target"] is None
    assert r["stats"]["groups_wanted"] is None  # a pinned batch sizes itself: no advice
    assert r["stats"]["peak_running_samples"] <= 3 * 4
    assert seen.peak <= 3 * 4
