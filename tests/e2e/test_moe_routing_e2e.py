"""Routing replay on the tiny MoE, end to end on CPU (real SGLang scheduler, torch-native MoE).

The oracle is SGLang itself: an uninterrupted `/generate` with `return_routed_experts` gives the
experts of every position. A rollout interrupted at any point and resumed, from a KV snapshot or
by re-prefilling, must return for every position exactly those experts (greedy, fp32, weights
unchanged), and a re-prefill must flag exactly the positions it recomputed.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_client import routed_experts as decode
from april_client.protocol import Sample
from april_server.models import ensure_tiny_moe
from tests.e2e.test_rollouts_e2e import GREEDY, R, clear_buffer, group, ok
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
LAYERS, TOP_K = 2, 2  # the tiny MoE (models.py)


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    args = ["--april-model", "tiny-moe", "--april-allow-stale-kv"]
    proc = ServerProc(tmp_path_factory.mktemp("april-moe"), args)
    # NOTE: kill9 crashes it and start() brings it back on the same state dir (durable buffer)
    proc.start()
    yield proc
    proc.stop()


@pytest.fixture()
def http(moe_server: ServerProc) -> Iterator[httpx.Client]:
    with moe_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def sglang_routing(http: httpx.Client, prompt: list[int], budget: int) -> tuple[list[int], Any]:
    """SGLang's own answer, uninterrupted: output ids and `[positions, layers, top_k]`."""
    body = {
        "input_ids": prompt,
        "sampling_params": {**GREEDY, "max_new_tokens": budget},
        "return_routed_experts": True,
    }
    out = ok(http.post("/generate", json=body))
    ids = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), dtype=np.int32)
    return out["output_ids"], ids.reshape(-1, LAYERS, TOP_K).astype(np.int16)


def as_sample(body: Any) -> Sample:
    return msgspec.convert(body, Sample)


def interrupt(http: httpx.Client, gid: str, prompt: list[int], budget: int, cut: int) -> Sample:
    """Run `gid` until a trigger group of `cut` tokens meets the quota; keep a snapshot (as
    tests/e2e/test_kv_snapshots_e2e.py, with routing asked by the call)."""
    for _ in range(3):
        body = {
            "groups": [group(gid, prompt, [budget]), group(gid + "-t", [1, 2], [cut])],
            "target_groups": 1,
            "on_quota": "snapshot",
            "resume_first": False,
            "max_inflight_groups": 2,
            "return_routed_experts": True,
        }
        r = ok(http.post(R + "/rollouts", json=body))
        if r["groups"][0]["group_id"] == gid + "-t":
            return as_sample(ok(http.get(f"{R}/partials/{gid}"))["samples"][0])
        http.delete(f"{R}/partials/{gid}-t")
    raise AssertionError("the trigger never finished first")


def test_a_rollout_returns_sglangs_routing_of_every_position(http: httpx.Client) -> None:
    prompt, budget = [5, 6, 7, 8, 9, 10, 11, 12], 24
    want_ids, want = sglang_routing(http, prompt, budget)
    body = {"groups": [group("m", prompt, [budget])], "return_routed_experts": True}
    s = as_sample(ok(http.post(R + "/rollouts", json=body))["groups"][0]["samples"][0])
    assert s.output_ids == want_ids
    assert s.routing is not None and s.routing.dtype == "uint8"
    got = decode.experts(s.routing)
    assert got.shape == (len(prompt) + budget - 1, LAYERS, TOP_K) == want.shape
    assert (got == want).all()
    assert [(x.start, x.end, x.segment, x.missing) for x in s.routing.spans] == [
        (0, got.shape[0], 0, False)
    ]
    assert len({int(e) for e in got.flatten()}) > TOP_K  # the router does spread tokens


def test_no_routing_unless_asked_and_a_group_may_ask_alone(http: httpx.Client) -> None:
    body = {
        "groups": [
            group("d", [5, 6, 7], [4]),
            {**group("e", [5, 6, 7], [4]), "return_routed_experts": True},
        ],
        "target_groups": 2,
    }
    got = {
        g["group_id"]: g["samples"][0] for g in ok(http.post(R + "/rollouts", json=body))["groups"]
    }
    assert got["d"]["routing"] is None and got["d"]["return_routed_experts"] is False
    assert as_sample(got["e"]).routing is not None


def test_a_dense_model_refuses_routing(tiny_server: ServerProc) -> None:
    with tiny_server.client() as c:
        body = {"groups": [group("dense", [5, 6, 7], [4])], "return_routed_experts": True}
        r = c.post(R + "/rollouts", json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "routing_unavailable"
        assert c.get(f"{R}/partials/dense").status_code == 404  # nothing was added


def test_routing_survives_kill9_and_resumes_exactly(
    http: httpx.Client, moe_server: ServerProc
) -> None:
    prompt, budget = [11, 12, 13, 14, 15], 150
    want_ids, want = sglang_routing(http, prompt, budget)
    s = interrupt(http, "k", prompt, budget, 6)
    assert s.routing is not None
    moe_server.kill9()
    moe_server.start()
    with moe_server.client() as c:
        back = as_sample(ok(c.get(f"{R}/partials/k"))["samples"][0])
        assert back.routing == s.routing  # durable, byte for byte
        out = ok(c.post(R + "/resume", json={"sample_ids": ["k/0"]}))
        done = as_sample(out["samples"][0])
    assert done.output_ids == want_ids and done.routing is not None
    assert (decode.experts(done.routing) == want).all()
    _, mask = decode.recomputed(done.routing)
    assert np.flatnonzero(mask).tolist() == list(range(s.routing.num_positions))  # re-prefilled


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    budget=st.integers(40, 120),
    cut=st.integers(3, 30),
    prompt=st.lists(st.integers(3, 300), min_size=1, max_size=8),
    restore=st.booleans(),
)
def test_interrupt_and_resume_keep_the_uninterrupted_routing(
    http: httpx.Client, budget: int, cut: int, prompt: list[int], restore: bool
) -> None:
    clear_buffer(http)
    want_ids, want = sglang_routing(http, prompt, budget)
    s = interrupt(http, "x", prompt, budget, cut)
    assert s.routing is not None and s.snapshot_bytes > 0
    known = s.routing.num_positions
    assert known == len(prompt) + len(s.output_ids) - 1
    assert (decode.experts(s.routing) == want[:known]).all()
    # Drop SGLang's radix copy: only the snapshot (restore) or a full prefill can continue it.
    assert http.post("/flush_cache").status_code == 200
    # ... and let another request's routing fill the capture rows of the KV slots a restore
    # will be given (a flush hands out the same slots again), so stale rows would show.
    sglang_routing(http, [301, 302, 303] * 40, 8)
    assert http.post("/flush_cache").status_code == 200
    kv = "restore" if restore else "recompute"
    out = ok(http.post(R + "/resume", json={"sample_ids": ["x/0"], "kv": kv}))
    s = as_sample(out["samples"][0])
    assert s.output_ids == want_ids
    assert s.routing is not None
    assert (decode.experts(s.routing) == want).all()  # every position: the original routing
    seg = s.segments[-1]
    rows, mask = decode.recomputed(s.routing)
    if restore:
        assert seg.kv == "restored"
        assert not mask.any()  # a restore recomputes nothing before the restore point
        # SGLang answers a request that matches the restored prefix from the capture rows of
        # its slots: the snapshot wrote its own back (door/moe_hooks.py), so they are right.
        body = {
            "input_ids": prompt + want_ids[:-1],
            "sampling_params": {**GREEDY, "max_new_tokens": 1},
            "return_routed_experts": True,
        }
        out = ok(http.post("/generate", json=body))
        assert out["meta_info"]["cached_tokens"] >= known
        rows = np.frombuffer(base64.b64decode(out["meta_info"]["routed_experts"]), np.int32)
        assert (rows.reshape(-1, LAYERS, TOP_K) == want).all()
    else:
        assert seg.kv == "recomputed" and seg.cached_tokens == 0
        assert np.flatnonzero(mask).tolist() == list(range(known))  # exactly the re-prefill
        assert (rows == want).all()  # same weights: it recomputed the same experts
    assert {x.weight_version for x in s.routing.spans} == {s.segments[0].weight_version}


def test_a_snapshot_keeps_its_routing_in_its_budget(http: httpx.Client) -> None:
    s = interrupt(http, "b", [9, 8, 7, 6], 200, 5)
    tokens = len(s.prompt_ids) + len(s.output_ids) - 1  # what its KV covers
    # fp32 K and V of 2 layers x 2 KV heads x 16 dims, and one int32 [layers, top_k] row
    kv_row, routing_row = 2 * 2 * 2 * 16 * 4, LAYERS * TOP_K * 4
    assert s.snapshot_bytes == tokens * (kv_row + routing_row)
    # Totals over whatever snapshots the store holds (others may come and go meanwhile):
    # each holds one routing row per token beside its KV rows.
    st = ok(http.get(R + "/stats"))
    assert (
        st["snapshot_routing_bytes"] == st["snapshot_tokens"] * routing_row >= tokens * routing_row
    )
    assert st["snapshot_bytes_used"] == st["snapshot_tokens"] * (kv_row + routing_row)


@pytest.mark.parametrize("kv", ["restore", "recompute"])
def test_a_push_between_segments_keeps_old_routing_and_flags_the_recomputed(
    http: httpx.Client, kv: str
) -> None:
    prompt, budget = [21, 22, 23, 24], 120
    want_ids, want = sglang_routing(http, prompt, budget)
    s = interrupt(http, "w", prompt, budget, 8)
    old = s.segments[0].weight_version
    assert s.routing is not None and s.snapshot_bytes > 0
    known = s.routing.num_positions
    new = f"moe-{kv}-{known}"  # the same files under a new version: tokens must not change
    body = {"model_path": str(ensure_tiny_moe()), "weight_version": new}
    assert ok(http.post("/update_weights_from_disk", json=body))["success"]
    resume = {"sample_ids": ["w/0"], "kv": kv, "max_staleness": 1}
    done = as_sample(ok(http.post(R + "/resume", json=resume))["samples"][0])
    assert done.output_ids == want_ids and done.routing is not None
    assert done.segments[-1].weight_version == new
    assert (decode.experts(done.routing) == want).all()
    versions = decode.versions(done.routing)
    assert versions[:known] == [old] * known  # every old position keeps its first routing
    assert versions[known:] == [new] * (len(versions) - known)
    rows, mask = decode.recomputed(done.routing)
    if kv == "restore":
        assert done.segments[-1].kv == "restored" and not mask.any()
    else:
        assert np.flatnonzero(mask).tolist() == list(range(known))
        assert {r.weight_version for r in done.routing.recomputed} == {new}
        assert (rows == want).all()  # same files: the recomputation routed alike


def test_the_client_asks_and_decodes(http: httpx.Client, moe_server: ServerProc) -> None:
    from april_client import AprilClient

    prompt, budget = [31, 32, 33], 10
    _, want = sglang_routing(http, prompt, budget)
    with AprilClient(moe_server.url) as client:
        out = client.rollout([group("c", prompt, [budget])], 1, return_routed_experts=True)
    r = out.groups[0].samples[0].routing
    assert r is not None and (decode.experts(r) == want).all()


@pytest.mark.parametrize("kv", ["auto", "recompute"])
def test_appended_tool_tokens_are_routed_in_context_order(http: httpx.Client, kv: str) -> None:
    prompt, budget, tool = [61, 62, 63, 64], 60, [70, 71, 72, 73, 74]
    s = interrupt(http, "a", prompt, budget, 6)
    so_far = list(s.output_ids)
    resume = {"sample_ids": ["a/0"], "append_ids": {"a/0": tool}, "kv": kv}
    done = as_sample(ok(http.post(R + "/resume", json=resume))["samples"][0])
    context = prompt + so_far + tool
    # the oracle: SGLang on the whole context at once, then the rest of the budget
    want_ids, want = sglang_routing(http, context, budget - len(so_far))
    assert done.output_ids[len(so_far) :] == want_ids
    assert done.routing is not None and done.response_ids == so_far + tool + want_ids
    assert done.routing.num_positions == len(prompt) + len(done.response_ids) - 1
    assert (decode.experts(done.routing) == want).all()
