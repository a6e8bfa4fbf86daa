"""The agent workload of `april-bench --agent` is seeded and reproducible, its turns per episode
and tool latencies are long-tailed with the asked median and 99th percentile, and its tool
answers are plain token ids that can never end a turn."""

from __future__ import annotations

import numpy as np
import pytest

from april_bench import options
from april_bench.agent import Episode, ModeFigures, table
from april_bench.agent_workload import AgentSettings, AgentWorkload


def test_every_draw_is_a_pure_function_of_seed_group_member_and_turn() -> None:
    a, b = AgentWorkload(AgentSettings(seed=3)), AgentWorkload(AgentSettings(seed=3))
    assert a.groups(0, 20) == b.groups(0, 20)
    assert a.group(7) == b.groups(5, 4)[2]  # whoever asks, in whatever order
    assert [a.tool_latency(4, 1, t) for t in range(1, 6)] == [
        b.tool_latency(4, 1, t) for t in range(1, 6)
    ]
    assert a.answer(4, 1, 2) == b.answer(4, 1, 2)
    other = AgentWorkload(AgentSettings(seed=4))
    assert a.groups(0, 20) != other.groups(0, 20)
    # Members and turns draw independently: no two turns of one episode share a latency.
    lat = {a.tool_latency(4, m, t) for m in range(2) for t in range(1, 6)}
    assert len(lat) == 10


def test_turns_per_episode_are_long_tailed_within_one_and_max_turns() -> None:
    wl = AgentWorkload(AgentSettings(max_turns=8, turns_p50=2.0))
    turns = np.array([g.max_turns for g in wl.groups(0, 4000)])
    assert turns.min() == 1 and turns.max() == 8
    assert np.median(turns) == 2
    # The tail: rare long episodes, about 1 % at the cap (p99 = max_turns, rounding moves it).
    assert 0.005 < np.mean(turns == 8) < 0.03
    assert np.mean(turns >= 4) > 0.1


def test_tool_latency_is_lognormal_with_the_asked_median_and_p99() -> None:
    wl = AgentWorkload(AgentSettings(tool_p50_s=0.5, tool_p99_s=6.0))
    lat = np.array(
        [wl.tool_latency(i, m, t) for i in range(500) for m in range(2) for t in range(1, 6)]
    )
    assert lat.min() > 0 and lat.max() <= 12.0  # clipped at twice the p99
    assert 0.45 < np.median(lat) < 0.55
    assert 4.5 < np.percentile(lat, 99) < 7.5
    assert lat.mean() > 1.5 * np.median(lat)  # the long tail pulls the mean up


def test_prompts_and_answers_are_plain_ids_inside_the_vocabulary() -> None:
    s = AgentSettings(vocab_size=448, turn_stop_ids=(370, 329, 34))
    wl = AgentWorkload(s)
    for g in wl.groups(0, 200):
        assert 8 <= len(g.input_ids) <= 24
        assert all(3 <= t < 448 and t not in s.turn_stop_ids for t in g.input_ids)
        for m in range(s.n):
            for turn in range(1, g.max_turns):
                ans = wl.answer(g.index, m, turn)
                assert 2 <= len(ans) <= 8
                assert all(3 <= t < 448 and t not in s.turn_stop_ids for t in ans)
    g = wl.group(0)
    assert wl.turns(g) == {"stop_token_ids": [370, 329, 34], "max_turns": g.max_turns}
    # ignore_eos would make SGLang skip the stop token ids too: turns could never end.
    assert "ignore_eos" not in wl.sampling_params(1.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        AgentSettings(max_turns=2, turns_p50=3.0)
    with pytest.raises(ValueError):
        AgentSettings(tool_p50_s=2.0, tool_p99_s=1.0)
    with pytest.raises(ValueError):
        AgentSettings(turn_stop_ids=())


def test_agent_flag_has_its_own_presets_and_explicit_flags_win() -> None:
    args = options.parse_args(["--agent", "--quick"])
    assert (args.steps, args.groups, args.n, args.max_tokens) == (6, 4, 2, 160)
    args = options.parse_args(["--agent", "--quick", "--steps", "5"])
    assert args.steps == 5
    assert (
        options.parse_args(["--quick"]).groups == options.QUICK["groups"]
    )  # unchanged without --agent


def test_figures_rate_idle_share_and_awaiting_time() -> None:
    fig = ModeFigures("april", steps=[2.0, 3.0], consumed_groups=2, generated_tokens=150)
    fig.episodes = [Episode(40, 3, 1.5, 2), Episode(60, 1, 0.0, 0)]
    fig.engine_busy_s = 4.0
    fig.engine = {"decode_tokens": 30.0, "decode_batches": 10.0, "prefill_s": 1.0}
    rec = fig.record()
    assert rec["mean_decode_batch"] == 3.0 and rec["engine_prefill_s"] == 1.0
    assert rec["consumed_tokens_per_s"] == 20.0  # 100 tokens in 5 s of rollout wall
    assert rec["engine_idle_share"] == 0.2
    assert rec["awaiting_input_s"] == 1.5 and rec["awaiting_s_per_answer"] == 0.75
    assert rec["turns_per_episode"] == 2.0
    sync = {**rec, "mode": "sync", "consumed_tokens_per_s": 10.0}
    assert "april vs sync: x2.00" in table([sync, rec])
