"""`GET /metrics` on the real server: our families and SGLang's own in one scrape."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.test_rollouts_e2e import R, clear_buffer, group, ok
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e


def families(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_metrics_has_april_and_sglang_families(tiny_server: ServerProc) -> None:
    with tiny_server.client() as c:
        clear_buffer(c)
        before = families(c.get("/metrics").text)
        groups = [group("m0", [3, 5], [4, 4]), group("m1", [7, 9], [4, 300])]
        r = ok(c.post(R + "/rollouts", json={"groups": groups, "target_groups": 1}))
        resp = c.get("/metrics")
        after = families(resp.text)
        ours = families(c.get(R + "/metrics").text)
        stats = ok(c.get(R + "/stats"))
        clear_buffer(c)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    assert after["april_rollout_calls_total"] == before["april_rollout_calls_total"] + 1
    assert after["april_buffered_groups"] == stats["buffered_groups"] >= 1
    assert after["april_output_tokens_total"] - before["april_output_tokens_total"] >= sum(
        len(s["output_ids"]) for g in r["groups"] for s in g["samples"]
    )
    # SGLang's scheduler families (it runs with --enable-metrics) come in the same scrape; its
    # context length is the model's (the tiny model's config), seen by SGLang, not by us.
    engine = {name: v for name, v in after.items() if name.startswith("sglang:")}
    assert "sglang:num_running_reqs" in engine and engine.get("sglang:context_len", 0) > 0
    assert not any(name.startswith("sglang:") for name in ours)
    # The engine just generated: it was busy part of the last minute, and the share is the
    # engine clock's (busy seconds over the window), the same in /stats and /metrics.
    clock = stats["engine_time"]
    assert 0 < clock["recent_busy_s"] <= clock["recent_window_s"] <= 60
    assert 0 <= stats["engine_idle_share"] < 1 and 0 <= stats["engine_idle_share_since_start"] < 1
    assert stats["engine_idle_share"] == pytest.approx(
        1 - clock["recent_busy_s"] / clock["recent_window_s"], abs=1e-3
    )
    assert 0 <= after["april_engine_idle_share"] < 1


def test_event_loop_lag_is_served(tiny_server: ServerProc) -> None:
    with tiny_server.client() as c:
        ok(c.get(R + "/stats"))  # the first april request starts the loop-lag monitor
        stats = ok(c.get(R + "/stats"))
        fams = families(c.get("/metrics").text)
    assert 0 <= stats["event_loop_lag_p99_s"] <= stats["event_loop_lag_max_s"]
    assert fams["april_event_loop_lag_max_s"] == pytest.approx(
        stats["event_loop_lag_max_s"], abs=1.0
    )
