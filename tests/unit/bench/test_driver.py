"""april-bench end to end against an in-process fake server (httpx ASGI transport): the driver's
accounting holds for sync and APRIL, outputs are written, a faulty server is caught, and
april-kv is refused unless the server really keeps KV snapshots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from april_bench import cli

BACKGROUND_STRIDE = 5  # tokens each background sample generates while the trainer trains


class FakeServer:
    """Native /generate plus a minimal APRIL rollout: the K groups with the least work left
    finish; everything else advances by as many tokens and is buffered. Background groups
    (`on_quota: continue`, `POST /groups`) advance by BACKGROUND_STRIDE tokens under the old
    version when a weight push arrives (what they generated while the trainer trained)."""

    def __init__(
        self, duplicate: bool = False, kv: Any = "not available", effective: str = ""
    ) -> None:
        self.version = "default"
        self.buffer: dict[str, dict[str, Any]] = {}
        self.duplicate, self.kv, self.effective = duplicate, kv, effective
        self.returned: list[dict[str, Any]] = []
        self.background: set[str] = set()
        self.background_tokens = 0
        self.calls: list[dict[str, Any]] = []  # every /rollouts body
        self.advice: int | None = None  # stats.groups_wanted
        self.app = FastAPI()
        get, post = self.app.get, self.app.post
        get("/model_info")(lambda: {"model_path": "/fake", "weight_version": self.version})
        get("/server_info")(lambda: {"skip_tokenizer_init": True, "version": "fake"})
        get("/v1/loads")(lambda: {"loads": [{"num_running_reqs": 3}]})
        get("/april/v1/partials")(lambda: {"groups": list(self.buffer.values())})
        post("/flush_cache")(lambda: Response())
        get("/april/v1/stats")(
            lambda: {
                "weight_version": self.version,
                "kv_snapshots": self.kv,
                "engine": {"vocab_size": 100},
                "background_groups": len(self.background),
                "background_output_tokens": self.background_tokens,
            }
        )
        self.app.delete("/april/v1/partials/{gid}")(self.delete)
        post("/update_weights_from_disk")(self.update)
        post("/april/v1/groups")(self.groups)
        post("/april/v1/abort")(self.abort)
        post("/generate")(self.generate)
        post("/april/v1/rollouts")(self.rollouts)

    async def update(self, request: Request) -> dict[str, Any]:
        for gid in self.background:
            for s in self.buffer[gid]["samples"]:
                self.background_tokens += self.advance(s, BACKGROUND_STRIDE)
        self.version = (await request.json())["weight_version"]
        return {"success": True}

    def delete(self, gid: str) -> dict[str, Any]:
        self.background.discard(gid)
        return {"deleted": self.buffer.pop(gid)}

    async def abort(self, request: Request) -> dict[str, Any]:
        self.background -= set((await request.json())["group_ids"])
        return {"samples": []}

    def new_group(self, g: dict[str, Any]) -> dict[str, Any]:
        gid, params = g["group_id"], g["member_params"]
        members = [self.sample(gid, j, p["max_new_tokens"]) for j, p in enumerate(params)]
        return {"group_id": gid, "samples": members}

    async def groups(self, request: Request) -> dict[str, Any]:
        body = await request.json()
        for g in body["groups"]:
            self.buffer[g["group_id"]] = self.new_group(g)
            if body["start"] == "background":
                self.background.add(g["group_id"])
        ids = [g["group_id"] for g in body["groups"]]
        return {"group_ids": ids, "started_samples": len(ids)}

    def advance(self, s: dict[str, Any], most: int) -> int:
        """Generate up to `most` tokens of `s` under the current version; how many it made."""
        gain = min(most, s["max_new_tokens"] - len(s["output_ids"]))
        if gain > 0:
            start = len(s["output_ids"])
            s["output_ids"] += [7] * gain
            seg = {"start": start, "end": start + gain, "kv": "fresh"}
            s["segments"].append({**seg, "weight_version": self.version})
        if len(s["output_ids"]) == s["max_new_tokens"]:
            s["status"] = "truncated"
        return max(gain, 0)

    async def generate(self, request: Request) -> Response:
        body = await request.json()
        k = body["sampling_params"]["max_new_tokens"]
        out = {
            "output_ids": [7] * k,
            "meta_info": {
                "completion_tokens": k,
                "finish_reason": {"type": "length"},
                "weight_version": self.version,
            },
        }
        if not body.get("stream"):
            return JSONResponse(out)
        chunks = [f"data: {json.dumps(out)}\n\n", "data: [DONE]\n\n"]
        return StreamingResponse(iter(chunks), media_type="text/event-stream")

    def sample(self, gid: str, j: int, budget: int) -> dict[str, Any]:
        return {
            "sample_id": f"{gid}/{j}",
            "group_id": gid,
            "index": j,
            "status": "partial",
            "output_ids": [],
            "segments": [],
            "max_new_tokens": budget,
        }

    async def rollouts(self, request: Request) -> Response:
        body = await request.json()
        self.calls.append(body)
        pool = list(self.buffer.values()) + [self.new_group(g) for g in body["groups"]]

        def left(g: dict[str, Any]) -> int:
            return max(s["max_new_tokens"] - len(s["output_ids"]) for s in g["samples"])

        k = body["target_groups"]
        take = sorted(pool, key=left)[:k]
        horizon, produced = left(take[-1]), 0
        for g in pool:
            for s in g["samples"]:
                produced += self.advance(s, horizon)
        ids = {g["group_id"] for g in take}
        if self.duplicate and self.returned:
            take[0] = self.returned[0]  # a buggy server: an old group again, a new one lost
        self.returned += take
        self.buffer = {g["group_id"]: g for g in pool if g["group_id"] not in ids}
        self.background -= ids
        if body["on_quota"] == "continue":
            self.background |= set(self.buffer)
        stats = {
            "weight_version": self.version,
            "output_tokens": produced,
            "recomputed_tokens": 0,
            "restored_kv_tokens": 0,
            "resumed_samples": 0,
            "on_quota_effective": self.effective or body["on_quota"],
            "groups_wanted": self.advice,
        }
        events = [{"event": "group_finished", "group": g} for g in take]
        events.append({"event": "done", "stats": stats, "buffered_group_ids": list(self.buffer)})
        return StreamingResponse(
            iter([json.dumps(e) + "\n" for e in events]), media_type="application/x-ndjson"
        )


def bench(server: FakeServer, tmp_path: Path, *extra: str) -> tuple[int, list[dict[str, Any]]]:
    out = tmp_path / "bench.jsonl"
    args = cli.parse_args(
        [
            "--url",
            "http://fake",
            "--steps",
            "3",
            "--groups",
            "2",
            "--n",
            "3",
            "--max-tokens",
            "64",
            "--no-progress",
            "--warmup",
            "0",
            "--poll-hz",
            "50",
            "--json-out",
            str(out),
            "--plot-dir",
            str(tmp_path / "plots"),
            *extra,
        ]
    )
    rc = cli.run(args, transport=httpx.ASGITransport(app=server.app))
    lines = out.read_text().splitlines() if out.exists() else []
    return rc, [json.loads(line) for line in lines]


def test_sync_and_april_consume_the_same_samples_and_lose_none(tmp_path: Path) -> None:
    server = FakeServer()
    rc, recs = bench(server, tmp_path, "--bump-version", "--stream-sync")
    assert rc == 0
    by_mode = {r["mode"]: r for r in recs}
    assert set(by_mode) == {"sync", "april", "april-kv", "april-async"}
    sync, april, kv = by_mode["sync"], by_mode["april"], by_mode["april-kv"]
    for r in (sync, april):
        assert r["checks_ok"] and r["checks"] == [] and r["mode_checks"] == []
        assert [s["consumed_samples"] for s in r["per_step"]] == [6, 6, 6]
        assert r["output_throughput"] > 0 and r["tokens_wasted"] == 0
    assert sync["output_throughput_vs_sync"] == 1.0 and sync["offpolicy_frac"] == 0.0
    assert sync["median_ttft_ms"] is not None  # streamed sync measures latencies
    assert april["offpolicy_frac"] > 0  # weight bumps make buffered tokens stale
    assert april["leftover_groups"] > 0 and april["leftover_tokens"] > 0
    assert server.buffer == {}  # the leftover was reported, then freed
    assert kv["available"] is False and kv["output_throughput"] is None
    assert "no KV snapshots" in kv["reason"]
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["running_requests.png", "step_throughput.png"]


def test_a_server_that_duplicates_a_group_fails_the_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, recs = bench(FakeServer(duplicate=True), tmp_path, "--modes", "april")
    assert rc == 1
    problems = "\n".join(recs[0]["checks"])
    assert "consumed twice" in problems and "lost" in problems
    assert "CHECK FAILED april" in capsys.readouterr().out


def test_april_kv_runs_only_when_snapshots_really_happen(tmp_path: Path) -> None:
    rc, recs = bench(FakeServer(kv={"available": True}), tmp_path, "--modes", "april-kv")
    assert rc == 0 and recs[0]["available"] is True and recs[0]["checks_ok"]
    rc, recs = bench(
        FakeServer(kv={"available": True}, effective="tokens"),
        tmp_path / "b",
        "--modes",
        "april-kv",
    )
    assert (
        recs[0]["available"] is False and "ran on_quota=snapshot as 'tokens'" in recs[0]["reason"]
    )


def test_a_non_empty_buffer_is_refused_unless_cleared(tmp_path: Path) -> None:
    server = FakeServer()
    server.buffer["someone-else"] = {"group_id": "someone-else", "samples": []}
    rc, _ = bench(server, tmp_path, "--modes", "sync")
    assert rc == 0  # sync does not touch the buffer
    rc, recs = bench(server, tmp_path / "x", "--modes", "april")
    assert rc == 2 and recs == []  # refused before running anything
    rc, _ = bench(server, tmp_path / "y", "--modes", "april", "--clear-buffer")
    assert rc == 0


def test_interleaved_modes_share_one_weight_bump_per_step(tmp_path: Path) -> None:
    server = FakeServer()
    rc, recs = bench(server, tmp_path, "--modes", "sync,april", "--interleave", "--bump-version")
    assert rc == 0 and [r["mode"] for r in recs] == ["sync", "april"]
    versions = [[s["weight_version"] for s in r["per_step"]] for r in recs]
    run_id = recs[0]["run_id"]
    assert versions[0] == versions[1] == ["default", f"{run_id}-v1", f"{run_id}-v2"]
    assert all(r["checks_ok"] and r["interleave"] for r in recs)
    with pytest.raises(SystemExit, match="one APRIL mode"):
        bench(server, tmp_path / "b", "--interleave")


def test_sequential_april_modes_do_not_resume_each_others_groups(tmp_path: Path) -> None:
    server = FakeServer(kv={"available": True})
    rc, recs = bench(server, tmp_path, "--modes", "april,april-kv")
    assert rc == 0 and all(r["checks_ok"] for r in recs), [r["checks"] for r in recs]
    assert all(r["leftover_groups"] > 0 for r in recs) and server.buffer == {}


def test_quick_sets_defaults_that_explicit_flags_override() -> None:
    quick = cli.parse_args(["--quick"])
    assert (quick.steps, quick.groups, quick.n, quick.max_tokens) == (6, 8, 4, 512)
    assert quick.bump_version is True and quick.over_sampling == 2.0
    assert cli.parse_args(["--quick", "--steps", "9"]).steps == 9
    assert cli.parse_args([]).bump_version is False
    assert cli.parse_args(["--quick", "--no-bump-version"]).bump_version is False


def test_simulate_after_a_run_measures_its_cost_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, recs = bench(
        FakeServer(),
        tmp_path,
        "--modes",
        "sync,april",
        "--simulate",
        "--sim-steps",
        "2",
        "--sim-groups",
        "2",
        "--sim-n",
        "2",
    )
    assert rc == 0 and recs[0]["cost_model"]["assumptions"]
    out = capsys.readouterr().out
    assert "simulated replay of this run's setup" in out and "measured in this run" in out
    assert "projection at scale" in out


def test_april_async_prefetches_the_next_step_and_keeps_an_exact_ledger(tmp_path: Path) -> None:
    server = FakeServer()
    rc, recs = bench(server, tmp_path, "--modes", "sync,april,april-async", "--train-s", "0.05")
    assert rc == 0
    by_mode = {r["mode"]: r for r in recs}
    aa = by_mode["april-async"]
    assert aa["checks_ok"] and aa["checks"] == [] and aa["mode_checks"] == []
    # Step 0 sends over-sampling x K = 4 groups; every later call sends none: the groups it
    # needs were handed in with POST /groups right after the previous call answered.
    calls = [c for c in server.calls if "april-async" in c["request_id"]]
    assert [len(c["groups"]) for c in calls] == [4, 0, 0]
    assert {c["on_quota"] for c in calls} == {"continue"}
    steps = aa["per_step"]
    assert [s["prefetched_groups"] for s in steps] == [2, 2, 0]  # none after the last step
    assert [s["buffered_groups"] for s in steps] == [2, 2, 2]
    assert aa["leftover_groups"] == 2 and server.buffer == {} and server.background == set()
    # Background tokens are counted as generated: nothing is wasted, nothing unaccounted.
    assert aa["background_tokens"] > 0 and aa["tokens_wasted"] == 0
    # They were generated under the version before each push: one version old when consumed.
    assert aa["staleness_hist"].get("1", 0) > 0 and aa["max_staleness_seen"] >= 1
    assert by_mode["sync"]["staleness_hist"] == {"0": by_mode["sync"]["consumed_tokens"]}
    for r in recs:
        assert [s["weight_version"] for s in r["per_step"]] == ["0", "1", "2"]
        assert r["train_s"] >= 3 * 0.05 and r["push_count"] == 2
        assert r["idle_push_s"] is not None and r["push_max_s"] >= r["push_p50_s"]
        assert r["run_wall_s"] >= r["rollout_wall_s"] + r["train_s"]
        assert 0 < r["wall_throughput"] < r["output_throughput"]
        later = r["per_step"][1:]  # past the first step: its own tokens over its own spans
        steady = sum(s["consumed_tokens"] for s in later) / sum(s["span_s"] for s in later)
        assert r["steady_wall_throughput"] == pytest.approx(steady, rel=1e-3)
        assert sum(r["staleness_hist"].values()) == r["consumed_tokens"]
        assert r["run_idle_frac"] is not None and r["wall_throughput_vs_sync"] is not None


def test_train_s_sets_training_time_pushes_and_step_versions() -> None:
    cfg = cli.config(cli.parse_args(["--train-s", "1.5"]))
    assert (cfg.train_time, cfg.bump_version, cfg.step_versions) == (1.5, True, True)
    old = cli.config(cli.parse_args(["--train-time", "2", "--bump-version"]))
    assert (old.train_time, old.bump_version, old.step_versions) == (2.0, True, False)
    with pytest.raises(SystemExit, match="drop --train-time"):
        cli.config(cli.parse_args(["--train-s", "1", "--train-time", "2"]))
    with pytest.raises(SystemExit, match="cannot take april-async"):
        cli.mode_specs(cli.parse_args(["--interleave", "--modes", "sync,april-async"]))


def test_april_async_is_refused_by_a_server_without_background_generation(
    tmp_path: Path,
) -> None:
    server = FakeServer()
    server.app.router.routes = [
        r for r in server.app.router.routes if getattr(r, "path", "") != "/april/v1/stats"
    ]
    server.app.get("/april/v1/stats")(
        lambda: {"weight_version": server.version, "kv_snapshots": "no"}
    )
    rc, recs = bench(server, tmp_path, "--modes", "april-async")
    assert rc == 0 and recs[0]["available"] is False
    assert "no background generation" in recs[0]["reason"]


def test_train_s_auto_trains_as_long_as_syncs_rollout(tmp_path: Path) -> None:
    """Issue #19's condition T = R, measured in the same run: sync trains as long as each of
    its steps' rollout took, the modes after it as long as sync's mean."""
    rc, recs = bench(FakeServer(), tmp_path, "--modes", "sync,april-async", "--train-s", "auto")
    assert rc == 0
    by_mode = {r["mode"]: r for r in recs}
    sync_steps = by_mode["sync"]["per_step"]
    for s in sync_steps:  # a sleep never ends early: at least the step's rollout wall
        assert s["wall_s"] > 0 and s["train_s"] >= s["wall_s"] * 0.99
    mean = sum(s["wall_s"] for s in sync_steps) / len(sync_steps)
    assert all(s["train_s"] >= mean * 0.99 for s in by_mode["april-async"]["per_step"])
    assert by_mode["april-async"]["wall_throughput_vs_sync"] is not None
    with pytest.raises(SystemExit, match="put sync first"):
        cli.mode_specs(cli.parse_args(["--modes", "april,sync", "--train-s", "auto"]))
    with pytest.raises(SystemExit, match="drop --train-time"):
        cli.config(cli.parse_args(["--train-s", "auto", "--train-time", "2"]))


def test_size_pool_holds_what_the_server_advised_under_auto(tmp_path: Path) -> None:
    server = FakeServer()
    server.advice = 7
    rc, _ = bench(server, tmp_path, "--modes", "april@auto,april@all", "--size-pool")
    assert rc == 0
    auto, static = server.calls[:3], server.calls[3:]
    assert len(auto[0]["groups"]) == 4  # nothing advised yet: over-sampling 2 x 2 groups
    assert [len(c["groups"]) for c in auto[1:]] == [5, 2]  # 7 held: 2 and 5 buffered before
    assert all(len(c["groups"]) <= 2 for c in static[1:])  # pinned: over-sampling only
    server = FakeServer()
    server.advice = 3  # fewer than over-sampling's 4: exactly that many held
    rc, _ = bench(server, tmp_path / "fewer", "--modes", "april@auto", "--size-pool")
    assert rc == 0 and [len(c["groups"]) for c in server.calls] == [4, 1, 2]
