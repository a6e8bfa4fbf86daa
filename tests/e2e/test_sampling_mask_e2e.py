"""Sampling masks across cuts, end to end on CPU (SGLang's `return_sampling_mask`, tiny model).

Greedy: an interrupted sample's rows (each its own token, logprob 0) are the uninterrupted
run's, on both KV paths and across a weight push. Sampled (top-k and top-p, unseeded): every
row is the kept set of its step and every sampling logprob is what a trainer recomputes over
that row, whatever cut the sample (a restore, a re-prefill, a push): `trainer_recompute.py`
runs the model itself (transformers, fp32) over the returned context. Seeded runs, where the
tokens themselves must repeat, are in test_seeded_e2e.py; kill -9 in test_crash_e2e.py; an
owner over engines in test_fleet_e2e.py.
"""

from __future__ import annotations

import base64
import threading
import time
from typing import Any

import httpx
import msgspec
import pytest

from april_client.protocol import SamplingMask
from april_server.models import ensure_tiny_model
from tests.e2e import trainer_recompute
from tests.e2e.test_rollouts_e2e import (
    R,
    assert_same_or_near_tie,
    clear_buffer,
    group,
    ok,
    reference,
)
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
TEMPERATURE, TOP_K, TOP_P = 0.8, 20, 0.9
SAMPLED = {"temperature": TEMPERATURE, "top_k": TOP_K, "top_p": TOP_P}
RECOMPUTE_TOLERANCE = 1e-3  # fp32 kernels: SGLang's and transformers' differ by ~1e-5


@pytest.fixture()
def http(tiny_server: ServerProc) -> httpx.Client:
    with tiny_server.client() as c:
        clear_buffer(c)
        yield c
        c.post(R + "/abort", json={"all": True})
        clear_buffer(c)


def cut(
    http: httpx.Client, groups: list[dict[str, Any]], after: int, on_quota: str
) -> dict[str, dict[str, Any]]:
    """Run `groups` with masks on beside a greedy trigger of `after` tokens that meets the quota
    first; the interrupted samples by group id. (A scheduling race on 2 busy cores can let a
    long group finish first: such an attempt is thrown away and run again.)"""
    gids = [g["group_id"] for g in groups]
    for _ in range(3):
        body = {
            "groups": [*groups, group("trigger", [1, 2], [after])],
            "target_groups": 1,
            "on_quota": on_quota,
            "resume_first": False,
            "max_inflight_groups": 16,
            "return_sampling_mask": True,
        }
        first = ok(http.post(R + "/rollouts", json=body))["groups"][0]["group_id"]
        http.delete(f"{R}/partials/trigger")
        if first == "trigger":
            return {gid: ok(http.get(f"{R}/partials/{gid}"))["samples"][0] for gid in gids}
        clear_buffer(http)
    raise AssertionError("the trigger never finished first")


def resume(http: httpx.Client, sid: str, kv: str) -> dict[str, Any]:
    out = ok(http.post(R + "/resume", json={"sample_ids": [sid], "kv": kv}))
    s: dict[str, Any] = out["samples"][0]
    return s


def stored_bytes_per_token(s: dict[str, Any]) -> float:
    """The record's size as the durable store encodes it (msgpack), per generated token."""
    m = s["sampling_mask"]
    mask = SamplingMask(
        m["dtype"], base64.b64decode(m["ids"]), base64.b64decode(m["counts"]), m["logprobs"]
    )
    return len(msgspec.msgpack.encode(mask)) / len(s["output_ids"])


def assert_greedy_rows(s: dict[str, Any]) -> None:
    """A greedy token's kept set is itself, its logprob over it 0."""
    m = s["sampling_mask"]
    assert trainer_recompute.rows(m) == [[t] for t in s["output_ids"]]
    assert m["logprobs"] == [0.0] * len(s["output_ids"])


def assert_trainer_recomputes_them(s: dict[str, Any]) -> tuple[float, int]:
    """Every row the kept set of its step; every sampling logprob the trainer's over its row.
    Returns the largest logprob difference and how many rows had a token near a cutoff."""
    assert len(trainer_recompute.rows(s["sampling_mask"])) == len(s["output_ids"])
    near = trainer_recompute.check_kept_sets(s, TEMPERATURE, TOP_K, TOP_P)
    gap = trainer_recompute.recompute_gap(s, TEMPERATURE)
    assert gap < RECOMPUTE_TOLERANCE, gap
    return gap, near


def test_greedy_rows_equal_the_uninterrupted_run_on_both_kv_paths(http: httpx.Client) -> None:
    prompt, budget = [21, 4, 5], 120
    want, top2 = reference(http, prompt, budget)
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": budget},
        "return_sampling_mask": True,
    }
    meta = ok(http.post("/generate", json=body))["meta_info"]  # SGLang's own, uninterrupted
    assert meta["output_token_sampling_mask"] == [[t] for t in want]
    groups = [group("r", prompt, [budget]), group("c", prompt, [budget])]
    held = cut(http, groups, 15, "snapshot")
    assert held["r"]["snapshot_bytes"] > 0
    assert 0 < len(held["c"]["sampling_mask"]["logprobs"]) == len(held["c"]["output_ids"])
    assert http.post("/flush_cache").status_code == 200  # only a snapshot spares a re-prefill
    r = resume(http, "r/0", "restore")
    c = resume(http, "c/0", "recompute")
    assert [seg["kv"] for seg in r["segments"]] == ["fresh", "restored"]
    assert [seg["kv"] for seg in c["segments"]] == ["fresh", "recomputed"]
    assert r["output_ids"] == want  # a restore reuses the original bits
    assert_same_or_near_tie(c["output_ids"], want, top2)
    for s in (r, c):
        assert_greedy_rows(s)
    print(f"greedy: {stored_bytes_per_token(r):.1f} bytes per token stored")


def test_sampled_rows_are_what_a_trainer_recomputes_across_cuts(http: httpx.Client) -> None:
    groups = [group(g, [30 + i, 7, 9], [160], **SAMPLED) for i, g in enumerate(("r", "c"))]
    held = cut(http, groups, 20, "snapshot")
    assert http.post("/flush_cache").status_code == 200
    r = resume(http, "r/0", "restore")
    c = resume(http, "c/0", "recompute")
    assert [seg["kv"] for seg in r["segments"]] == ["fresh", "restored"]
    assert [seg["kv"] for seg in c["segments"]] == ["fresh", "recomputed"]
    for s in (r, c):
        cut_at = s["segments"][1]["start"]
        before = held[s["group_id"]]
        assert s["output_ids"][:cut_at] == before["output_ids"]
        assert s["sampling_mask"]["logprobs"][:cut_at] == before["sampling_mask"]["logprobs"]
        kept = trainer_recompute.rows(s["sampling_mask"])[:cut_at]
        assert kept == trainer_recompute.rows(before["sampling_mask"])
        gap, near = assert_trainer_recomputes_them(s)
        sizes = [len(row) for row in trainer_recompute.rows(s["sampling_mask"])]
        print(
            f"{s['segments'][1]['kv']}: cut at {cut_at}, {len(sizes)} rows of 1-{max(sizes)} "
            f"ids (mean {sum(sizes) / len(sizes):.1f}), trainer recompute max |diff| "
            f"{gap:.2e}, {near} rows near a cutoff, "
            f"{stored_bytes_per_token(s):.1f} bytes per token stored"
        )


def test_rows_across_a_weight_push(http: httpx.Client) -> None:
    """A push mid-call cuts both samples at the version boundary; the same files reloaded,
    the greedy one goes on as if uninterrupted and the sampled one's rows stay its steps'."""
    prompt, budget = [22, 4, 5], 1500  # still generating when the push lands
    want, top2 = reference(http, prompt, budget)
    old = ok(http.get(R + "/stats"))["weight_version"]
    groups = [group("g", prompt, [budget]), group("s", [40, 7, 9], [budget], **SAMPLED)]
    body = {"groups": groups, "target_groups": 2, "return_sampling_mask": True}
    out: dict[str, Any] = {}
    call = threading.Thread(
        target=lambda: out.setdefault("r", http.post(R + "/rollouts", json=body))
    )
    call.start()
    deadline = time.monotonic() + 60
    while ok(http.get(R + "/stats"))["running_samples"] < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    assert ok(http.get(R + "/stats"))["running_samples"] == 2
    new = f"{old}-masks"
    push = {"model_path": str(ensure_tiny_model()), "weight_version": new}
    assert ok(http.post("/update_weights_from_disk", json=push))["success"]
    call.join(timeout=600)
    got = {g["group_id"]: g["samples"][0] for g in ok(out["r"])["groups"]}
    for s in got.values():
        assert [seg["weight_version"] for seg in s["segments"]] == [old, new], s["segments"]
    assert_same_or_near_tie(got["g"]["output_ids"], want, top2)
    assert_greedy_rows(got["g"])
    gap, near = assert_trainer_recomputes_them(got["s"])
    boundary = got["s"]["segments"][1]["start"]
    print(f"push at token {boundary}: trainer recompute max |diff| {gap:.2e}, {near} near")


def test_params_that_give_no_mask_are_refused(http: httpx.Client) -> None:
    top_p_only = group("p", [3, 4], [8], temperature=1.0, top_p=0.9)
    r = http.post(R + "/rollouts", json={"groups": [top_p_only], "return_sampling_mask": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sampling_params"
    assert "top_k" in r.json()["error"]["message"]
    cut(http, [group("x", [3, 4], [300], **SAMPLED)], 4, "tokens")
    body = {"sample_ids": ["x/0"], "sampling_params": {"top_k": -1}}
    r = http.post(R + "/resume", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_sampling_params"
    # The same override with the mask turned off is fine.
    done = ok(http.post(R + "/resume", json={**body, "return_sampling_mask": False}))
    assert done["samples"][0]["sampling_mask"] is None
