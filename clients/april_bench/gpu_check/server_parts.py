"""The parts of the GPU check that start april-server and run april-bench on it (and the
environment and configs parts, which check the server's plugin and command line), each
returning a JSON-able entry with a ``status``: "ok", "failed", "not run: no CUDA" or
"skipped: <why>". Device parts record the exact commands they run (or would run), so a dry run
shows them. The kernel parts are `kernels.gpu_check.parts`."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from april_server.launcher import LaunchedServer
from kernels.gpu_check.parts import NO_CUDA
from kernels.gpu_check.run import ROOT, Context, child_env, run_cmd, shown


@dataclass
class DeviceRun:
    """The run's context and the april-server that the resume and april-bench parts share."""

    ctx: Context
    server: LaunchedServer | None = None


MODEL_DIR = ROOT / "kernels" / "configs" / "llama-3.1-8b"
RESUME_LENGTHS = (1024, 4096, 16384)
RESUME_REPEATS = 3
# An 8B-shaped model with random weights: the real architecture and KV size, no download.
SERVER_ARGS = [
    "--model-path",
    str(MODEL_DIR),
    "--load-format",
    "dummy",
    "--skip-tokenizer-init",  # token ids only: no tokenizer files are shipped
    "--mem-fraction-static",
    "0.80",
    "--cuda-graph-max-bs-decode",
    "80",  # the bench runs <= 64 samples; less to capture
    "--april-kv-host-bytes",
    str(16 << 30),  # two 16k-token 8B snapshots are 4 GiB
]
BENCH_ARGS = [
    "--modes", "sync,april@all,april@auto",
    "--steps", "6", "--groups", "8", "--n", "4", "--max-tokens", "512",
    "--over-sampling", "2", "--no-bump-version",  # dummy weights cannot be reloaded from disk
    "--clear-buffer", "--no-progress",
]  # fmt: skip


PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN = "april = april_server.door.scheduler_hooks:register"  # as in pyproject.toml


def ensure_plugin_entry_point(out_dir: Path) -> str:
    """SGLang finds our scheduler hooks (KV snapshots) by entry point, which exists only once
    april-server is pip-installed. With the repository merely on PYTHONPATH (e.g. in the SGLang
    image, offline), declare it in a minimal dist-info put on PYTHONPATH for every child."""
    from importlib.metadata import entry_points

    if any(ep.name == "april" for ep in entry_points(group=PLUGIN_GROUP)):
        return "installed"
    site = out_dir / "site"
    info = site / "april_server_gpu_check-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: april-server-gpu-check\nVersion: 0.0\n"
    )
    (info / "entry_points.txt").write_text(f"[{PLUGIN_GROUP}]\n{PLUGIN}\n")
    paths = (str(site), os.environ.get("PYTHONPATH"))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return f"declared in {info}"


def environment(ctx: Context) -> dict[str, Any]:
    import torch
    import triton

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": ctx.cuda,
        "device": torch.cuda.get_device_name() if ctx.cuda else "CPU",
        "april_sglang_plugin": ensure_plugin_entry_point(ctx.out_dir),
    }
    try:
        import sglang

        info["sglang"] = sglang.__version__
    except Exception as exc:  # the device parts need it; say why they will fail
        info["sglang"] = f"not importable: {exc}"
    return {"status": "ok", "results": info}


def configs(ctx: Context) -> dict[str, Any]:
    """The shipped model config loads (transformers and SGLang's ModelConfig), and the server
    and april-bench command lines parse with this SGLang's and april-bench's own parsers."""
    import argparse

    from transformers import AutoConfig

    from april_bench.options import parse_args as bench_parse_args
    from april_server.cli import april_parser

    cfg = AutoConfig.from_pretrained(MODEL_DIR)
    with warnings.catch_warnings():  # SGLang warns on import about CPU-less quantizations
        warnings.simplefilter("ignore")
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.server_args import ServerArgs

    model = ModelConfig(str(MODEL_DIR))
    kv_bytes = 2 * model.num_hidden_layers * model.get_num_kv_heads(1) * model.head_dim * 2
    april, sglang_argv = april_parser().parse_known_args(SERVER_ARGS)
    sglang_parser = argparse.ArgumentParser(allow_abbrev=False)
    ServerArgs.add_cli_args(sglang_parser)
    sglang_parser.parse_args(sglang_argv)  # exits on an unknown or ambiguous flag
    bench_parse_args(["--url", "http://127.0.0.1:1", *BENCH_ARGS])
    return {
        "status": "ok",
        "results": {
            "model_dir": str(MODEL_DIR.relative_to(ROOT)),
            "architecture": cfg.architectures[0],
            "layers": model.num_hidden_layers,
            "kv_heads": model.get_num_kv_heads(1),
            "head_dim": model.head_dim,
            "context_len": model.context_len,
            "kv_bytes_per_token_bf16": kv_bytes,
            "kv_host_bytes": april.april_kv_host_bytes,
            "server_args_parse": True,
            "bench_args_parse": True,
        },
    }


def start_server(run: DeviceRun) -> dict[str, Any]:
    command = shown(["python", "-m", "april_server", *SERVER_ARGS])
    if not run.ctx.cuda:
        return {"status": NO_CUDA, "command": command}
    timeout = run.ctx.allow(240)
    if timeout < 60:
        return {"status": "skipped: out of time budget", "command": command}
    run.server = LaunchedServer(SERVER_ARGS, keep_dir=True)
    t0 = time.monotonic()
    try:
        run.server.start(timeout_s=timeout)
    except RuntimeError as exc:
        run.server = None
        return {"status": "failed", "command": command, "error": str(exc)[-3000:]}
    return {"status": "ok", "command": command, "seconds": round(time.monotonic() - t0, 1)}


def resume(run: DeviceRun) -> dict[str, Any]:
    """Resume of an interrupted 8B sample after flush_cache: KV restore vs re-prefill."""
    import httpx

    from april_bench.resume import R, interrupted_pair, timed_resume

    what = {
        "lengths": list(RESUME_LENGTHS),
        "repeats": RESUME_REPEATS,
        "command": "april_bench.resume's interrupted_pair + timed_resume on the server",
    }
    ctx = run.ctx
    if run.server is None:
        return {"status": NO_CUDA if not ctx.cuda else "skipped: no server", **what}
    rows: list[dict[str, Any]] = []
    with httpx.Client(base_url=run.server.url, timeout=max(ctx.allow(180), 10)) as c:
        for length in RESUME_LENGTHS:
            if ctx.allow(180) < 20:
                return {"status": "skipped: out of time budget", "results": rows, **what}
            rows.append(_resume_length(c, length, R, interrupted_pair, timed_resume))
        stats = c.get(R + "/stats").json()
    keys = ("save_gbps_mean", "restore_gbps_mean", "snapshots_evicted", "snapshots_rejected")
    return {"status": "ok", "results": rows, "store": {k: stats.get(k) for k in keys}, **what}


def _resume_length(
    c: Any, length: int, R: str, interrupted_pair: Any, timed_resume: Any
) -> dict[str, Any]:
    rec: list[float] = []
    res: list[float] = []
    cached: list[int] = []
    same: list[bool] = []
    for k in range(RESUME_REPEATS):
        tag = f"gpu-L{length}-{k}"
        interrupted_pair(c, tag, length)
        c.post("/flush_cache").raise_for_status()
        t_rec, s_rec = timed_resume(c, f"{tag}/0", "recompute")
        c.post("/flush_cache").raise_for_status()
        t_res, s_res = timed_resume(c, f"{tag}/1", "restore")
        if s_res["segments"][-1]["kv"] != "restored":
            raise RuntimeError(f"{tag}: not restored: {s_res['segments'][-1]}")
        rec.append(t_rec)
        res.append(t_res)
        cached.append(s_res["segments"][-1]["cached_tokens"])
        same.append(s_rec["output_ids"] == s_res["output_ids"])
        c.delete(f"{R}/partials/{tag}")
    return {
        "partial_tokens": length,
        "recompute_s": statistics.median(rec),
        "restore_s": statistics.median(res),
        "speedup": statistics.median(rec) / statistics.median(res),
        "restored_cached_tokens": min(cached),
        "same_output": all(same),  # dummy weights: ties are likely, so this is a note only
    }


def april_bench(run: DeviceRun) -> dict[str, Any]:
    """april-bench sync vs static (april@all) vs adaptive (april@auto) on the 8B server."""
    ctx = run.ctx
    out = ctx.out_dir / "april_bench.jsonl"
    url = run.server.url if run.server is not None else "URL"
    cmd = ctx.python("-m", "april_bench.cli", "--url", url, *BENCH_ARGS, "--json-out", str(out))
    if run.server is None:
        status = NO_CUDA if not ctx.cuda else "skipped: no server"
        return {"status": status, "command": shown(cmd)}
    timeout = ctx.allow(240)
    if timeout < 60:
        return {"status": "skipped: out of time budget", "command": shown(cmd)}
    out.unlink(missing_ok=True)
    res = run_cmd(cmd, timeout)
    entry: dict[str, Any] = {"status": "ok" if res.ok else "failed", **res.summary()}
    if out.exists():
        keys = ("mode", "output_throughput", "output_throughput_vs_sync", "checks_ok", "reason")
        lines = out.read_text().splitlines()
        entry["results"] = [{k: json.loads(x).get(k) for k in keys} for x in lines]
    return entry


def stop_server(run: DeviceRun) -> None:
    if run.server is not None:
        log = Path(run.server.log_path)
        if log.exists():
            (run.ctx.out_dir / "server.log").write_text(log.read_text(errors="replace")[-200_000:])
        run.server.keep_dir = False
        run.server.stop()
        run.server = None


MOE_TESTS = "tests/e2e/test_moe_routing_e2e.py"


def moe_routing(run: DeviceRun) -> dict[str, Any]:
    """Routing replay on the tiny MoE on the device: SGLang's CUDA MoE path and
    capturer, the same e2e checks as on CPU (every position's routing equals an uninterrupted
    run's after interrupt + resume on both KV paths, across a push and kill -9). Last: the 8B
    server is stopped first, so the MoE server gets the device's memory."""
    ctx = run.ctx
    cmd = ctx.python("-m", "pytest", "-q", "-p", "no:cacheprovider", MOE_TESTS, "-k", "not dense")
    if not ctx.cuda:
        return {"status": NO_CUDA, "command": shown(cmd)}
    timeout = ctx.allow(200)
    if timeout < 60:
        return {"status": "skipped: out of time budget", "command": shown(cmd)}
    stop_server(run)
    res = run_cmd(cmd, timeout, env=child_env())
    return {"status": "ok" if res.ok else "failed", **res.summary()}
