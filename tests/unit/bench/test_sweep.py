"""april-bench's mode specs (`april@auto`) and sweep configurations: parsing and the table."""

from __future__ import annotations

import pytest

from april_bench import cli, options
from april_bench.driver import ModeSpec
from april_bench.server_api import BenchError
from april_bench.sweep import PRESETS, SweepPoint, repeat_order, sweep_points, sweep_table


def test_mode_spec_policies() -> None:
    assert ModeSpec.parse("april@auto") == ModeSpec("april", "auto", "april@auto")
    assert ModeSpec.parse("april-kv@16").max_inflight == "16"
    assert ModeSpec.parse("april", default_inflight="auto").max_inflight == "auto"
    assert ModeSpec.parse("april").label == "april"
    assert ModeSpec.parse("april@all").slug == "april-at-all"
    assert ModeSpec.parse("april-async") == ModeSpec("april-async", "all", "april-async")
    assert ModeSpec.parse("april-async@auto").slug == "april-async-at-auto"
    for bad in ("sync@auto", "april@0", "april@many", "turbo", "april@"):
        with pytest.raises(BenchError):
            ModeSpec.parse(bad)


def test_cli_mode_lists() -> None:
    specs = cli.mode_specs(options.parse_args(["--modes", "sync,april@all,april@auto"]))
    assert [s.label for s in specs] == ["sync", "april@all", "april@auto"]
    sweep = cli.mode_specs(options.parse_args(["--sweep"]), sweep=True)
    assert [s.label for s in sweep] == ["sync", "april@all", "april@auto"]
    for argv in (
        ["--modes", "april,april"],
        ["--modes", "sync,april@auto,april@all", "--interleave"],
        ["--modes", "april@x"],
    ):
        with pytest.raises(SystemExit):
            cli.mode_specs(options.parse_args(argv))


def test_sweep_points() -> None:
    assert [p.name for p in PRESETS] == [
        "tiny:512:8x4",
        "tiny:1024:8x4",
        "tiny:512:16x4",
        "smollm2:128:4x4",
    ]
    assert SweepPoint.parse("smollm2:256:2x8") == SweepPoint("smollm2", 256, 2, 8)
    assert sweep_points(False, ["tiny:64:2x2"]) == [SweepPoint("tiny", 64, 2, 2)]
    both = sweep_points(True, ["tiny:512:8x4", "tiny:64:2x2"])  # no repeats
    assert len(both) == 5 and both[-1].name == "tiny:64:2x2"
    for bad in ("llama:512:8x4", "tiny:512:8", "tiny:0:8x4", "tiny:512:8x0"):
        with pytest.raises(BenchError):
            SweepPoint.parse(bad)


def test_sweep_with_url_is_refused() -> None:
    with pytest.raises(SystemExit, match="drop --url"):
        cli.run_sweep(options.parse_args(["--sweep", "--url", "http://x"]))


def test_sweep_table_puts_configurations_side_by_side() -> None:
    def rec(mode: str, tok: float | None, ratio: float | None, **kw: object) -> dict[str, object]:
        return {
            "mode": mode,
            "available": tok is not None,
            "output_throughput": tok,
            "output_throughput_vs_sync": ratio,
            "checks_ok": True,
            **kw,
        }

    a = [
        rec("sync", 100.0, 1.0),
        rec("april@all", 150.0, 1.5),
        rec("april@auto", 160.0, 1.6, inflight_targets=[40, 32]),
    ]
    b = [
        rec("sync", 50.0, 1.0),
        rec("april@all", None, None),
        rec("april@auto", 49.0, 0.98, inflight_targets=[]),
    ]
    text = sweep_table([(SweepPoint("tiny", 512, 8, 4), a), (SweepPoint("smollm2", 128, 4, 4), b)])
    lines = text.splitlines()
    assert "april@all tok/s" in lines[0] and "running target" in lines[0]
    assert lines[2].split() == [
        "tiny:512:8x4",
        "100.0",
        "150.0",
        "x1.50",
        "160.0",
        "x1.60",
        "40/32",
        "ok",
    ]
    assert lines[3].split() == [
        "smollm2:128:4x4",
        "50.0",
        "n/a",
        "n/a",
        "49.0",
        "x0.98",
        "n/a",
        "ok",
    ]


def test_repeats_alternate_the_april_modes_order() -> None:
    labels = ["sync", "april@all", "april@auto"]
    assert repeat_order(labels, 0) == labels
    assert repeat_order(labels, 1) == ["sync", "april@auto", "april@all"]
    assert repeat_order(labels, 2) == labels
    with pytest.raises(SystemExit, match="at least 1"):
        cli.run_sweep(options.parse_args(["--sweep-point", "tiny:8:1x1", "--repeat", "0"]))


def test_sweep_table_gives_median_and_range_over_repeats() -> None:
    def rec(mode: str, tok: float, ratio: float, targets: list[int] | None = None) -> dict:
        return {
            "mode": mode,
            "available": True,
            "output_throughput": tok,
            "output_throughput_vs_sync": ratio,
            "checks_ok": True,
            "inflight_targets": targets or [],
        }

    runs = [
        rec("sync", 100.0, 1.0),
        rec("april@auto", 150.0, 1.5, [40, 30]),
        rec("sync", 120.0, 1.0),
        rec("april@auto", 130.0, 1.08, [38]),
        rec("sync", 90.0, 1.0),
        rec("april@auto", 180.0, 2.0, [44]),
    ]
    runs[-1]["checks_ok"] = False
    line = sweep_table([(SweepPoint("tiny", 512, 8, 4), runs)]).splitlines()[2]
    assert line.split() == [
        "tiny:512:8x4",
        "100.0",
        "(90.0-120.0)",
        "150.0",
        "(130.0-180.0)",
        "x1.50",
        "(x1.08-x2.00)",
        "39",
        "(30-44)",
        "FAIL",
    ]


def test_sweep_table_with_training_compares_wall_throughput_and_async_to_april() -> None:
    def rec(mode: str, rep: int, wall: float, sync_wall: float) -> dict:
        return {
            "mode": mode,
            "available": True,
            "repeat": rep,
            "checks_ok": True,
            "output_throughput": 999.0,
            "output_throughput_vs_sync": 9.0,
            "wall_throughput": wall,
            "wall_throughput_vs_sync": wall / sync_wall,
            "steady_wall_throughput_vs_sync": 2 * wall / sync_wall,
        }

    runs = [
        rec("sync", 0, 100.0, 100.0),
        rec("april", 0, 120.0, 100.0),
        rec("april-async", 0, 180.0, 100.0),
        rec("sync", 1, 50.0, 50.0),
        rec("april", 1, 80.0, 50.0),
        rec("april-async", 1, 80.0, 50.0),
    ]
    lines = sweep_table([(SweepPoint("tiny", 512, 8, 4), runs)], wall=True).splitlines()
    assert "sync wall tok/s" in lines[0] and lines[0].split()[-2:] == ["april", "checks"]
    # x april is the median of the per-repeat ratios (1.5 and 1.0), not a ratio of medians
    assert lines[0].split().count("steady") == 2  # april and april-async: past the first step
    assert lines[2].split() == [
        "tiny:512:8x4",
        "75.0",
        "(50.0-100.0)",
        "100.0",
        "(80.0-120.0)",
        "x1.40",
        "(x1.20-x1.60)",
        "x2.80",
        "(x2.40-x3.20)",
        "130.0",
        "(80.0-180.0)",
        "x1.70",
        "(x1.60-x1.80)",
        "x3.40",
        "(x3.20-x3.60)",
        "x1.25",
        "(x1.00-x1.50)",
        "ok",
    ]


def test_sweep_table_gives_each_modes_fraction_of_the_bound_measured_in_its_run() -> None:
    def rec(mode: str, tok: float, bound: float, thrown: float) -> dict:
        return {
            "mode": mode,
            "available": True,
            "output_throughput": tok,
            "output_throughput_vs_sync": tok / 100.0,
            "bound_tok_s": bound,
            "output_throughput_vs_bound": tok / bound,
            "thrown_away_share": thrown,
            "checks_ok": True,
        }

    runs = [rec("sync", 100.0, 400.0, 0.0), rec("april", 300.0, 400.0, 0.02)]
    table = sweep_table([(SweepPoint("tiny", 512, 8, 4), runs)]).splitlines()
    assert table[0].split() == [
        "configuration",
        "bound",
        "tok/s",
        "sync",
        "tok/s",
        "sync",
        "x",
        "bound",
        "april",
        "tok/s",
        "x",
        "sync",
        "x",
        "bound",
        "thrown",
        "%",
        "checks",
    ]
    assert table[2].split() == [
        "tiny:512:8x4",
        "400",
        "100.0",
        "0.25",
        "300.0",
        "x3.00",
        "0.75",
        "2.0%",
        "ok",
    ]
