"""april-bench's discrete-event model: same accounting as the real loop, a gain only where a
small batch wastes capacity, and a calibration that recovers the cost model it was fed."""

from __future__ import annotations

import pytest

from april_bench import simulate as sim
from april_bench.cli import main
from april_bench.metrics import StepRecord

SETUP = sim.SimSetup(
    steps=8, groups=8, n=4, over_sampling=2.0, max_tokens=512, engines=1, prompt_len=32
)


def model(a: float, c: float, prefill: float = 0.0) -> sim.CostModel:
    return sim.CostModel("test", a=a, c=c, prefill_s=prefill, restore_s=0.0)


def test_every_mode_consumes_k_groups_per_step_and_sync_is_on_policy() -> None:
    cost = model(1e-3, 1e-4)
    for mode in ("sync", "april", "april-kv"):
        r = sim.run_sim(mode, SETUP, cost)
        assert len(r.walls) == SETUP.steps and all(w > 0 for w in r.walls)
    sync = sim.run_sim("sync", SETUP, cost)
    assert sync.offpolicy == 0 and sync.recomputed == 0
    april = sim.run_sim("april", SETUP, cost)
    assert april.offpolicy > 0 and april.recomputed > 0


def test_overhead_bound_engine_gains_and_saturated_engine_does_not() -> None:
    overhead = model(a=1e-2, c=1e-5)
    gain = sim.run_sim("april", SETUP, overhead).throughput
    assert gain / sim.run_sim("sync", SETUP, overhead).throughput > 1.2
    saturated = model(a=0.0, c=1e-3, prefill=1e-3)  # cost per token, whatever the batch
    ratio = (
        sim.run_sim("april", SETUP, saturated).throughput
        / sim.run_sim("sync", SETUP, saturated).throughput
    )
    assert ratio <= 1.0


def test_kv_restore_is_cheaper_than_re_prefill_when_prefill_is_expensive() -> None:
    cost = sim.CostModel("t", a=1e-3, c=1e-4, prefill_s=1e-3, restore_s=1e-6)
    kv = sim.run_sim("april-kv", SETUP, cost)
    assert kv.throughput > sim.run_sim("april", SETUP, cost).throughput
    assert kv.restored > 0 and kv.recomputed == 0


def test_calibration_recovers_the_cost_model() -> None:
    a, c = 4e-3, 2e-4
    steps = [
        StepRecord(i, a * mx + c * tok, 0.0, 32, tok, tok, max_budget=mx)
        for i, (mx, tok) in enumerate([(512, 4000), (300, 3500), (480, 2600), (200, 2000)])
    ]
    cost, text = sim.calibrate(steps)
    assert cost.a == pytest.approx(a) and cost.c == pytest.approx(c)
    assert "ms/iteration" in text


def test_simulate_cli_prints_a_labelled_projection(capsys: pytest.CaptureFixture[str]) -> None:
    main(
        [
            "--simulate",
            "--sim-steps",
            "3",
            "--sim-groups",
            "4",
            "--sim-n",
            "2",
            "--sim-max-tokens",
            "1024",
            "--sim-engines",
            "2",
        ]
    )
    out = capsys.readouterr().out
    assert "SIMULATION (a model, not a measurement)" in out
    assert "assumption:" in out and "april-kv" in out
