"""KV snapshots end to end on CPU: save on interruption, restore without re-prefill."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_server.models import ensure_tiny_model
from tests.e2e.test_rollouts_e2e import R, clear_buffer, group, ok, reference
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
PAGE = 1  # the CPU default page size


@pytest.fixture()
def http(tiny_server: ServerProc) -> httpx.Client:
    with tiny_server.client() as c:
        clear_buffer(c)
        yield c
        clear_buffer(c)


def interrupt(http: httpx.Client, gid: str, prompt: list[int], budget: int, cut: int) -> Any:
    """Run `gid` until a trigger group of `cut` tokens meets the quota; keep a snapshot.

    NOTE: on 2 shared cores the scheduler has (rarely, ~1 in 300 calls seen) admitted the long
    request well before the trigger, letting it finish first; that is a scheduling race, not
    what these tests check, so such an attempt is discarded and tried again (3 times at most).
    """
    for _ in range(3):
        body = {
            "groups": [group(gid, prompt, [budget]), group(gid + "-t", [1, 2], [cut])],
            "target_groups": 1,
            "on_quota": "snapshot",
            "resume_first": False,
            "max_inflight_groups": 2,  # the trigger runs beside gid, or nothing is interrupted
        }
        r = ok(http.post(R + "/rollouts", json=body))
        assert r["stats"]["on_quota_effective"] == "snapshot"
        if r["groups"][0]["group_id"] == gid + "-t":
            return ok(http.get(f"{R}/partials/{gid}"))["samples"][0]
        http.delete(f"{R}/partials/{gid}-t")
    raise AssertionError(f"the trigger never finished first: {r['stats']}")


def stats(http: httpx.Client) -> Any:
    return ok(http.get(R + "/stats"))


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    budget=st.integers(60, 300),
    cut=st.integers(3, 40),
    prompt=st.lists(st.integers(0, 300), min_size=1, max_size=8),
)
def test_restore_after_flush_is_exact_and_skips_prefill(
    http: httpx.Client, budget: int, cut: int, prompt: list[int]
) -> None:
    clear_buffer(http)
    want, _ = reference(http, prompt, budget)
    s = interrupt(http, "x", prompt, budget, cut)
    assert s["snapshot_bytes"] > 0
    # Drop SGLang's own radix copy, so only the snapshot can avoid the re-prefill.
    assert http.post("/flush_cache").status_code == 200
    out = ok(http.post(R + "/resume", json={"sample_ids": ["x/0"], "kv": "restore"}))
    s = out["samples"][0]
    context = len(prompt) + s["segments"][1]["start"]
    seg = s["segments"][1]
    assert seg["kv"] == "restored"
    assert seg["cached_tokens"] >= context - PAGE, (seg, context)
    assert s["output_ids"] == want  # a restore reuses the original bits: no near-tie excuse
    clear_buffer(http)


def test_restore_refused_without_snapshot(http: httpx.Client) -> None:
    # y and its trigger side by side (pinned), y long enough to be cut by the quota
    body = {
        "groups": [group("y", [3], [1000]), group("y-t", [1], [4])],
        "target_groups": 1,
        "on_quota": "tokens",
        "resume_first": False,
        "max_inflight_groups": 2,
    }
    assert ok(http.post(R + "/rollouts", json=body))["buffered_group_ids"] == ["y"]
    r = http.post(R + "/resume", json={"sample_ids": ["y/0"], "kv": "restore"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_snapshot"


def test_cycles_leave_no_leak(http: httpx.Client) -> None:
    assert http.post("/flush_cache").status_code == 200
    base = stats(http)
    baseline = base["free_tokens"] + base["evictable_tokens"]
    for i in range(100):
        s = interrupt(http, f"c{i}", [i % 50 + 1, 7], 400, 2 + i % 5)
        assert s["snapshot_bytes"] > 0
        if i % 3 == 0:  # drop
            assert http.delete(f"{R}/partials/c{i}").status_code == 200
        else:  # restore, run a little, interrupt again (a new snapshot), then delete
            body = {
                "groups": [group(f"c{i}-u", [3], [2 + i % 4])],
                "target_groups": 1,
                "on_quota": "snapshot",
            }
            r = ok(http.post(R + "/rollouts", json=body))
            http.delete(f"{R}/partials/{r['groups'][0]['group_id']}")
            live = ok(http.get(R + "/partials"))["groups"]
            st_ = stats(http)
            assert st_["snapshot_bytes_used"] == sum(
                x["snapshot_bytes"] for g in live for x in g["samples"]
            )
            http.delete(f"{R}/partials/c{i}")
        http.delete(f"{R}/partials/c{i}-t")
    end = stats(http)
    assert end["snapshots"] == 0 and end["snapshot_bytes_used"] == 0
    assert end["restore_locks"] == 0 and end["protected_tokens"] == 0
    assert end["free_tokens"] + end["evictable_tokens"] == baseline
    assert end["restored_kv_tokens"] > base["restored_kv_tokens"]


def test_weight_update_blocks_auto_reuse_unless_stale_allowed(http: httpx.Client) -> None:
    s = interrupt(http, "w", [5, 6], 300, 5)
    v0 = s["snapshot_weight_version"]
    body = {"model_path": str(ensure_tiny_model()), "weight_version": f"{v0}-next"}
    assert ok(http.post("/update_weights_from_disk", json=body))["success"]
    assert stats(http)["weight_version"] == f"{v0}-next"
    # kv: auto under a newer version re-prefills (the server allows stale reuse, the caller
    # did not ask for it)...
    ok(
        http.post(
            R + "/rollouts",
            json={
                "groups": [group("w2", [8], [300]), group("w2-t", [1], [5])],
                "on_quota": "snapshot",
                "resume_first": False,
                "max_inflight_groups": 2,
            },
        )
    )
    out = ok(http.post(R + "/resume", json={"sample_ids": ["w/0"], "kv": "auto"}))
    assert out["samples"][0]["segments"][-1]["kv"] == "recomputed"
    r = http.post(R + "/resume", json={"sample_ids": ["w2/0"], "kv": "restore"})
    assert r.status_code == 200  # same version: fine
    # ...and reuses a one-version-old snapshot when max_staleness allows it.
    s3 = interrupt(http, "w3", [9, 9], 300, 5)
    body = {"model_path": str(ensure_tiny_model()), "weight_version": f"{v0}-third"}
    assert ok(http.post("/update_weights_from_disk", json=body))["success"]
    out = ok(
        http.post(R + "/resume", json={"sample_ids": ["w3/0"], "kv": "auto", "max_staleness": 1})
    )
    seg = out["samples"][0]["segments"]
    assert [x["weight_version"] for x in seg] == [s3["snapshot_weight_version"], f"{v0}-third"]
    assert seg[-1]["kv"] == "restored"


def test_restored_stale_pages_serve_only_their_own_continuation(http: httpx.Client) -> None:
    """#23 (suspected): with stale reuse allowed, a snapshot of older weights restored for the
    sample that opted in must not enter the shared prefix cache, where any request with the
    same prefix (another member of the group, a plain /generate) would reuse old-weights KV
    without having asked."""
    s = interrupt(http, "sp", [11, 12, 13], 300, 5)
    v0 = s["snapshot_weight_version"]
    body = {"model_path": str(ensure_tiny_model()), "weight_version": f"{v0}-sp"}
    assert ok(http.post("/update_weights_from_disk", json=body))["success"]
    out = ok(
        http.post(R + "/resume", json={"sample_ids": ["sp/0"], "kv": "auto", "max_staleness": 1})
    )
    seg = out["samples"][0]["segments"][-1]
    assert seg["kv"] == "restored" and seg["cached_tokens"] > 0  # the caller's own reuse
    prefix = [11, 12, 13] + s["output_ids"]
    gen = {"input_ids": prefix, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    meta = ok(http.post("/generate", json=gen))["meta_info"]
    assert meta["cached_tokens"] == 0, meta  # nothing of the old weights' KV is shared
