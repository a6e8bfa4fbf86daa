"""`april-bench --agent` against a real CPU server: two tiny steps of sync and APRIL on the
multi-turn workload (every episode may take 3 turns, tools answer in tens of ms). A smoke
test of the whole loop (turn stops, tool answers during and between calls, the figures, the
leftover freed), not a timing test: no timed asserts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from april_bench import agent, cli
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e


def test_agent_bench_runs_sync_and_april_on_the_tiny_server(
    tiny_server: ServerProc, tmp_path: Path
) -> None:
    out = tmp_path / "agent.jsonl"
    args = cli.parse_args(
        [
            "--agent",
            "--url",
            tiny_server.url,
            "--steps",
            "2",
            "--groups",
            "2",
            "--n",
            "2",
            "--max-tokens",
            "48",
            "--agent-max-turns",
            "3",
            "--agent-turns-p50",
            "3",
            "--agent-tool-p50-s",
            "0.05",
            "--agent-tool-p99-s",
            "0.3",
            "--no-progress",
            "--json-out",
            str(out),
        ]
    )
    assert agent.main(args) == 0
    recs = {r["mode"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"sync", "april"}
    for r in recs.values():
        assert r["notes"] == [], r["notes"]  # no tool answer refused or failed
        assert r["consumed_groups"] == 4 and r["consumed_episodes"] == 8
        assert r["consumed_tokens"] > 0 and r["consumed_tokens_per_s"] > 0
        assert 1 <= r["turns_per_episode"] <= 3
        assert 0.0 <= r["engine_idle_share"] <= 1.0
        assert r["generated_tokens"] >= r["consumed_tokens"]
    # 8 episodes of up to 48 tokens, a turn stop ~1 token in 10: tools answered in both modes.
    for r in recs.values():
        assert r["tool_answers"] > 0 and r["awaiting_input_s"] > 0, r
    assert recs["sync"]["leftover_groups"] == 0
    with tiny_server.client() as c:  # the leftover was reported, then freed
        left = [
            g["group_id"]
            for g in c.get("/april/v1/partials").json()["groups"]
            if "-april-g" in g["group_id"]
        ]
        assert left == []
        assert c.get("/april/v1/stats").json()["awaiting_input_samples"] == 0
