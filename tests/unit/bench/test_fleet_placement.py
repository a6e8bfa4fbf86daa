"""`python -m april_bench.fleet --placements a,b --repeat N`: the placements alternate
over the same engines, and the summary's ratio is taken within each repeat."""

from __future__ import annotations

from typing import Any

from april_bench import fleet


def rec(placement: str, rep: int, tps: float, err: float) -> dict[str, Any]:
    return {
        "layout": "owner+2",
        "mode": "april@auto",
        "placement": placement,
        "repeat": rep,
        "output_throughput": tps,
        "length_prediction": {"mean_abs_error_tokens": err},
    }


def test_the_summary_takes_medians_and_per_repeat_ratios() -> None:
    rows = [
        rec("least_loaded", 0, 100.0, 30),
        rec("tail", 0, 110.0, 40),
        rec("tail", 1, 90.0, 50),
        rec("least_loaded", 1, 100.0, 20),
        rec("least_loaded", 2, 80.0, 25),
        rec("tail", 2, 100.0, 45),
    ]
    lines = fleet.placement_table(rows).splitlines()
    assert lines == [
        "owner+2 april@auto least_loaded: 100.0 (80.0-100.0) out tok/s  x least_loaded 1.00 "
        "(1.00-1.00)  prediction |error| 25 (20-30) tokens (3 runs)",
        "owner+2 april@auto         tail: 100.0 (90.0-110.0) out tok/s  x least_loaded 1.10 "
        "(0.90-1.25)  prediction |error| 45 (40-50) tokens (3 runs)",
    ]


def test_placements_alternate_their_order_between_repeats(monkeypatch: Any) -> None:
    ran: list[tuple[str, int]] = []

    class Engine:
        url = "http://e"

        def __init__(self, *a: Any, **k: Any) -> None:
            pass

        def stop(self) -> None:
            pass

    def owner_bench(engines: Any, placement: str, bench_args: list[str]) -> list[dict[str, Any]]:
        ran.append((placement, len(engines)))
        return [{"mode": "april@auto"}]

    monkeypatch.setattr(fleet, "LaunchedServer", Engine)
    monkeypatch.setattr(fleet, "start_all", lambda procs: None)
    monkeypatch.setattr(fleet, "owner_bench", owner_bench)
    recs = fleet.run_layout(2, [], "0", placements=["least_loaded", "tail"], repeat=3)
    assert ran == [("least_loaded", 2), ("tail", 2), ("tail", 2), ("least_loaded", 2)] + [
        ("least_loaded", 2),
        ("tail", 2),
    ]
    assert [(r["placement"], r["repeat"]) for r in recs] == [
        ("least_loaded", 0),
        ("tail", 0),
        ("tail", 1),
        ("least_loaded", 1),
        ("least_loaded", 2),
        ("tail", 2),
    ]
