"""april-bench against a real CPU server: two tiny steps of sync, APRIL and APRIL-async with a
trainer's pause and weight push between them write sound JSONL records and both plots. A
benchmark, not a timing test: no timed asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from april_bench import cli
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e


def test_bench_sync_and_april_on_the_tiny_server(tiny_server: ServerProc, tmp_path: Path) -> None:
    out, plots = tmp_path / "bench.jsonl", tmp_path / "plots"
    args = cli.parse_args(
        [
            "--url",
            tiny_server.url,
            "--modes",
            "sync,april,april-async",
            "--steps",
            "2",
            "--groups",
            "2",
            "--n",
            "2",
            "--max-tokens",
            "48",
            "--train-s",
            "0.3",
            "--stream-sync",
            "--clear-buffer",
            "--no-progress",
            "--bound-s",
            "3",
            "--json-out",
            str(out),
            "--plot-dir",
            str(plots),
        ]
    )
    assert cli.run(args) == 0
    recs = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"sync", "april", "april-async"}
    for r in recs.values():
        assert r["available"] and r["checks_ok"], r["checks"]
        assert r["output_throughput"] > 0 and r["mode_checks"] == []
        assert [s["consumed_samples"] for s in r["per_step"]] == [4, 4]
        # Every generated token (april-async: in the background too) consumed or left over.
        assert r["tokens_wasted"] == 0, r
        assert [s["weight_version"] for s in r["per_step"]] == ["0", "1"]
        assert r["push_count"] == 1 and r["idle_push_s"] is not None
        assert sum(r["staleness_hist"].values()) == r["consumed_tokens"]
        assert 0 < r["wall_throughput"] < r["output_throughput"]
        # The engine's own clock: both kinds ran, and they fit in the rollout wall (not for
        # april-async: its window also holds background forwards before the call paused them).
        assert r["engine_prefill_s"] > 0 and r["engine_decode_s"] > 0, r
        if r["mode"] != "april-async":
            assert r["engine_other_s"] > -0.05 * r["rollout_wall_s"], r
    # The next step's groups went in right after step 0's call; step 1's call sent none.
    assert [s["prefetched_groups"] for s in recs["april-async"]["per_step"]] == [2, 0]
    # Sync: every request's first token comes from its prefill, the rest from decode steps.
    sync = recs["sync"]
    assert sync["engine_decode_tokens"] + sync["consumed_samples"] == sync["generated_tokens"], sync
    assert sync["engine_prefill_requests"] == sync["consumed_samples"]
    # The bound, measured before the modes (a short phase: its largest level), and every
    # mode's fraction of it; the wall by cause adds up to the wall, the gap's shares to 1.
    assert sync["bound_tok_s"] > 0 and sync["bound_levels"], sync["bound_stopped"]
    for r in recs.values():
        assert r["output_throughput_vs_bound"] > 0
        causes = r["wall_by_cause"]
        parts = ("decode_full_s", "decode_tail_s", "prefill_resumed_s", "prefill_new_s")
        total = sum(causes[k] for k in parts) + causes["outside_forwards_s"]
        assert abs(total - r["rollout_wall_s"]) < 1e-3 * r["rollout_wall_s"] + 1e-3
        assert causes["engine_idle_s"] >= 0  # the scheduler's idle hook ran
        assert abs(sum(r["gap_to_bound"].values()) - 1.0) < 1e-3
    assert recs["sync"]["median_e2e_latency_ms"] is not None
    assert recs["april"]["output_throughput_vs_sync"] is not None
    for name in ("running_requests.png", "step_throughput.png"):
        assert (plots / name).stat().st_size > 10_000
    with tiny_server.client() as c:  # the leftover buffer was reported, then freed
        ours = [
            g
            for g in c.get("/april/v1/partials").json()["groups"]
            if g["group_id"].startswith(recs["april"]["run_id"])
        ]
        assert ours == [] and c.get("/april/v1/stats").json()["background_groups"] == 0


@pytest.mark.parametrize(
    "repeat", [pytest.param(1, id="quick"), pytest.param(2, id="full", marks=pytest.mark.slow)]
)
def test_sweep_compares_static_and_adaptive_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], repeat: int
) -> None:
    """`--sweep-point` launches its own server per configuration and run, alternates the APRIL
    modes' order between repeats, and prints one table (of medians over repeats). Quick: one
    run (one server start); full: two, alternated."""
    out = tmp_path / "sweep.jsonl"
    argv = [
        "--sweep-point",
        "tiny:40:2x2",
        "--steps",
        "2",
        "--no-progress",
        "--warmup",
        "0",
        "--repeat",
        str(repeat),
        "--bound-s",
        "0",
        "--json-out",
        str(out),
    ]
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    assert done.value.code == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    order = [[r["mode"] for r in recs if r["repeat"] == rep] for rep in range(repeat)]
    alternated = [["sync", "april@all", "april@auto"], ["sync", "april@auto", "april@all"]]
    assert order == alternated[:repeat]
    assert {r["sweep_point"] for r in recs} == {"tiny:40:2x2"}
    assert len({r["run_id"] for r in recs}) == repeat  # a fresh server and run per repeat
    for r in recs:
        assert r["available"] and r["checks_ok"], r["checks"]
        assert [s["consumed_samples"] for s in r["per_step"]] == [4, 4]
        if r["mode"] == "april@all":
            assert r["inflight_targets"] == []  # pinned: the server chose nothing
        if r["mode"] == "april@auto":
            assert len(r["inflight_targets"]) == 2
    table = capsys.readouterr().out.split("== sweep:")[1]
    assert "tiny:40:2x2" in table
    assert ("median (min-max) of 2 runs" in table) == (repeat == 2)
    row = next(line for line in table.splitlines() if line.strip().startswith("tiny:40:2x2"))
    # 5 medians + the target range over repeats, each "median (min-max)"; one run: values
    assert row.count("(") == (6 if repeat == 2 else 0) and row.rstrip().endswith("ok"), row
