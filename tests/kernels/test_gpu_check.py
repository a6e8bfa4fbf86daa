"""scripts/gpu-check.sh's driver (april_bench.gpu_check, over the kernel parts in
kernels/gpu_check/), the parts a CPU can exercise: the report with device-shaped results, the
time budget, timeouts, the plugin entry point.
(`scripts/gpu-check.sh --dry-run` runs the real CPU parts; not here: the AOT part takes ~90 s.)"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import time

import pytest

from april_bench.gpu_check import __main__ as gpu_check
from april_bench.gpu_check.report import markdown
from april_bench.gpu_check.server_parts import DeviceRun, ensure_plugin_entry_point
from kernels.gpu_check.run import Context, run_cmd

DEVICE_REPORT = {
    "started_at": "2026-01-01T00:00:00+00:00",
    "dry_run": False,
    "total_s": 512.3,
    "parts": {
        "environment": {"status": "ok", "seconds": 3.0, "results": {
            "device": "NVIDIA H200", "torch": "2.14.1", "triton": "3.8.0", "sglang": "0.5.23"}},
        "parity": {"status": "ok", "seconds": 80.0, "results": {
            "cases": 480, "failures": 0, "kernel_tests_passed": "729"}},
        "kv_bandwidth": {"status": "ok", "seconds": 60.0, "results": {"rows": [
            {"model": "Llama-3.1-8B", "tokens": 16384, "MiB": 2048.0,
             "ceiling save": 51.2, "ceiling restore": 49.8, "torch save": 20.5,
             "torch restore": 18.25, "triton save": 47.0, "triton restore": 45.5,
             "sglang save": None, "sglang restore": 30.0}]}},
        "server": {"status": "ok", "seconds": 70.0, "command": "python -m april_server ..."},
        "resume": {"status": "ok", "seconds": 40.0, "results": [
            {"partial_tokens": 16384, "recompute_s": 1.25, "restore_s": 0.125, "speedup": 10.0,
             "restored_cached_tokens": 16383, "same_output": True}]},
        "april_bench": {"status": "failed", "seconds": 240.0, "results": [
            {"mode": "sync", "output_throughput": 1000.0, "output_throughput_vs_sync": 1.0,
             "checks_ok": True},
            {"mode": "april@auto", "output_throughput": 1500.0,
             "output_throughput_vs_sync": 1.5, "checks_ok": True}]},
    },
}  # fmt: skip


def test_report_renders_device_results():
    text = markdown(DEVICE_REPORT)
    assert text.startswith("# GPU check (NVIDIA H200)")
    assert "| parity | ok | 80.0 | 480 cases, 0 failures; kernel tests: 729 passed |" in text
    assert (
        "| Llama-3.1-8B | 16384 | 2048.0 | 51.2 | 49.8 | 47.0 | 45.5 | 20.5 | 18.2 | — | 30.0 |"
        in text
    )
    assert "| 16384 | 1.250 | 0.125 | x10.00 | 16383 |" in text
    assert "| april@auto | 1500.0 | x1.50 | True |" in text
    assert "april@auto 1500.0 tok/s (x1.50)" in text  # summary line of the failed part too


def test_dry_run_report_shows_commands_of_device_parts():
    report = {
        "started_at": "t",
        "dry_run": True,
        "total_s": 1.0,
        "parts": {
            "kv_bandwidth": {
                "status": "not run: no CUDA",
                "seconds": 0.0,
                "command": "python -m kernels.bench_kv_copy --device cuda",
            }
        },
    }
    text = markdown(report)
    assert "(dry run, no CUDA)" in text
    assert "| kv_bandwidth | not run: no CUDA | 0.0 | python -m kernels.bench_kv_copy" in text


def test_budget_cuts_every_part_timeout(tmp_path):
    ctx = Context(dry_run=True, cuda=False, out_dir=tmp_path, budget_s=100.0)
    assert 80 < ctx.allow(300) <= 90  # the budget minus the 10 s kept for the report
    assert ctx.allow(20) == 20
    ctx.started -= 95
    assert ctx.allow(300) == 0


def test_timeout_kills_the_whole_process_group():
    t0 = time.monotonic()
    # The grandchild keeps the output pipe open: only a group kill lets this return early.
    res = run_cmd(["bash", "-c", "sleep 60 & sleep 60"], timeout_s=1)
    assert res.returncode is None and not res.ok
    assert time.monotonic() - t0 < 20
    assert "killed at its 1 s timeout" in res.output


def test_plugin_entry_point_is_declared_when_april_server_is_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.environ.get("PYTHONPATH", ""))  # restored afterwards
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    assert ensure_plugin_entry_point(tmp_path).startswith("declared in ")
    probe = (
        "from importlib.metadata import entry_points;"
        "print([e.value for e in entry_points(group='sglang.srt.plugins') if e.name == 'april'])"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert "april_server.door.scheduler_hooks:register" in out.stdout, out.stderr
    assert str(tmp_path / "site") in os.environ["PYTHONPATH"].split(os.pathsep)


def test_a_failing_part_is_reported_and_the_others_still_run(tmp_path, monkeypatch):
    def fine(run):
        return {"status": "ok", "results": None}

    def broken(run):
        raise RuntimeError("device fell off the bus")

    monkeypatch.setattr(
        gpu_check, "plan", lambda run, with_aot: [("a", fine), ("b", broken), ("c", fine)]
    )
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [e["status"] for e in report["parts"].values()] == ["ok", "failed", "ok"]
    assert "device fell off the bus" in report["parts"]["b"]["error"]
    assert report["dry_run"] is True
    assert "| b | failed |" in (tmp_path / "gpu-check.md").read_text()


@pytest.mark.parametrize("flag", [[], ["--aot"]])
def test_device_plan_has_every_part_and_aot_only_on_request(tmp_path, flag):
    run = DeviceRun(Context(dry_run=False, cuda=True, out_dir=tmp_path, budget_s=570))
    names = [name for name, _ in gpu_check.plan(run, with_aot=bool(flag))]
    expected = ["parity", "kv_bandwidth", "server", "resume", "april_bench", "moe_routing"]
    assert names == ["environment", "configs", *(["aot"] if flag else []), *expected]
