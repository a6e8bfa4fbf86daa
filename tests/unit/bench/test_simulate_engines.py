"""april-bench's model at many engines: placement as april-server does it (snapshot affinity,
then least loaded), round-robin kept for comparison, and the engine-count sweep (weak scaling)
with the same accounting as one engine. A pure model: exact figures, no timing."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from april_bench import simulate as sim
from april_bench.cli import main
from april_bench.workload import Workload

MODES = ("sync", "april", "april-kv")
SETUP = sim.SimSetup(
    steps=6, groups=8, n=4, over_sampling=2.0, max_tokens=512, engines=4, prompt_len=32
)
COST = sim.CostModel("test", a=1e-3, c=1e-4, prefill_s=1e-4, restore_s=1e-6)


def test_a_resume_restores_where_its_snapshot_is_and_the_rest_go_to_the_least_loaded() -> None:
    held = [sim._Member(100, done=10, engine=0) for _ in range(3)]
    fresh = [sim._Member(100) for _ in range(5)]
    kv = sim._place("april-kv", SETUP, held + fresh)
    # the snapshots' engine restores them; fresh samples fill the emptier engines, lowest first
    assert kv == [(0, True)] * 3 + [(1, False), (2, False), (3, False), (1, False), (2, False)]
    # without snapshots (plain april) a resume is placed like any other sample: by count, then
    # KV need (the resumes' 42-token context + 0.7 x 90 left exceeds a fresh 32 + 0.7 x 100)
    plain = sim._place("april", SETUP, held + fresh)
    assert [e for e, _ in plain] == [0, 1, 2, 3, 3, 0, 1, 2] and not any(r for _, r in plain)
    rr = sim._place("april-kv", replace(SETUP, routing="round_robin"), held + fresh)
    assert rr == [
        (0, True),
        (1, False),
        (2, False),
        (3, False),
        (0, False),
        (1, False),
        (2, False),
        (3, False),
    ]


def test_least_loaded_restores_every_resume_and_round_robin_re_prefills_some() -> None:
    kv = sim.run_sim("april-kv", SETUP, COST)
    assert kv.resumes > 0 and kv.resumes_restored == kv.resumes
    assert kv.restored_share == 1.0 and kv.recomputed == 0 and kv.restored > 0
    rr = sim.run_sim("april-kv", replace(SETUP, routing="round_robin"), COST)
    assert rr.resumes > 0 and rr.restored_share is not None and rr.restored_share < 1.0
    assert rr.recomputed > 0
    plain = sim.run_sim("april", SETUP, COST)  # re-prefills every resume, wherever it runs
    assert plain.resumes > 0 and plain.resumes_restored == 0 and plain.restored == 0


def test_one_engine_gives_the_same_result_under_both_policies() -> None:
    one = replace(SETUP, engines=1)
    for mode in MODES:
        ll = sim.run_sim(mode, one, COST)
        rr = sim.run_sim(mode, replace(one, routing="round_robin"), COST)
        assert asdict(ll) == asdict(rr)
        assert ll.imbalance == 1.0


def test_the_sweep_has_a_row_per_engine_count_and_mode_with_consistent_accounting() -> None:
    counts = [1, 2, 4]
    rows = sim.sweep(SETUP, COST, MODES, counts, groups_per_engine=2)
    assert [(r.engines, r.mode) for r in rows] == [(e, m) for e in counts for m in MODES]
    wl = Workload("longtail", SETUP.n, SETUP.max_tokens, seed=SETUP.seed)
    for r in rows:
        assert r.groups == 2 * r.engines  # weak scaling
        assert len(r.walls) == len(r.consumed) == SETUP.steps and all(w > 0 for w in r.walls)
        assert r.generated == sum(r.consumed) + r.buffered
        assert r.resumes_restored <= r.resumes and r.imbalance >= 1.0
        if r.mode == "sync":  # K whole groups of the stream per step, nothing left over
            k = r.groups
            assert r.consumed == [
                sum(sum(wl.group(i).budgets) for i in range(s * k, (s + 1) * k))
                for s in range(SETUP.steps)
            ]
            assert r.buffered == r.resumes == r.offpolicy == 0
        else:
            assert r.buffered > 0 and r.resumes > 0
    fixed = sim.sweep(SETUP, COST, MODES, counts)  # strong scaling: the same K everywhere
    assert {r.groups for r in fixed} == {SETUP.groups}


def test_throughput_grows_with_engines_under_weak_scaling() -> None:
    rows = sim.sweep(SETUP, COST, MODES, [1, 2, 4, 8], groups_per_engine=2)
    for mode in MODES:
        tput = [r.throughput for r in rows if r.mode == mode]
        assert all(b > a for a, b in zip(tput, tput[1:], strict=False)), (mode, tput)


def test_an_unknown_routing_is_refused() -> None:
    with pytest.raises(ValueError, match="routing"):
        sim.run_sim("april", replace(SETUP, routing="random"), COST)


def test_simulate_cli_sweeps_engine_counts(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--simulate",
            "--sim-steps",
            "2",
            "--sim-n",
            "2",
            "--sim-max-tokens",
            "256",
            "--sim-engines",
            "1,2,4",
            "--sim-groups-per-engine",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "weak scaling: K = 2 x engines" in out and "routing least_loaded" in out
    rows = [x.split() for x in out.splitlines() if x[:7].strip().isdigit() and "april-kv" in x]
    assert [(r[0], r[1]) for r in rows] == [("1", "2"), ("2", "4"), ("4", "8")]
    main(
        [
            "--simulate",
            "--sim-steps",
            "2",
            "--sim-n",
            "2",
            "--sim-max-tokens",
            "256",
            "--sim-engines",
            "1,2",
            "--sim-groups",
            "3",
            "--sim-routing",
            "round_robin",
        ]
    )
    out = capsys.readouterr().out
    assert "strong scaling" in out and "routing round_robin" in out and "placement" in out


@pytest.mark.parametrize("bad", ["0", "2,x", "2,2", ""])
def test_simulate_cli_refuses_bad_engine_counts(bad: str) -> None:
    with pytest.raises(SystemExit):
        main(["--simulate", "--sim-engines", bad])
