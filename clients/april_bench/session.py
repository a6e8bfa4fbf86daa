"""One benchmark session against one server: probe, warm up, run each mode in turn on the same
workload stream, and cross-check the modes' sample accounting."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time
from datetime import datetime, timezone
from typing import Any

import httpx

from .accounting import compare_modes
from .bound import Bound, measure_again, measure_bound
from .calibrate import measure_cost_model
from .driver import BenchConfig, ModeRunner, ModeSpec
from .metrics import ModeResult
from .server_api import (
    BenchError,
    LoadPoller,
    ServerInfo,
    buffered_groups,
    bump_version,
    check,
    delete_groups,
    flush_cache,
    forget_lengths,
    probe,
)
from .staleness_ceiling import for_run as staleness_ceiling_for
from .workload import Workload, load_lengths


def make_workload(args: argparse.Namespace, cfg: BenchConfig, vocab: int) -> Workload:
    lengths = []
    if args.workload == "jsonl":
        if args.lengths_file is None:
            raise BenchError("--workload jsonl needs --lengths-file")
        lengths = load_lengths(args.lengths_file)
    return Workload(
        args.workload,
        cfg.n,
        cfg.max_tokens,
        seed=args.seed,
        vocab_size=vocab,
        lengths=lengths,
        prompts=getattr(args, "prompts", 8),
    )


async def warmup(http: httpx.AsyncClient, cfg: BenchConfig, wl: Workload, rounds: int) -> None:
    """Short concurrent generations so first-call costs do not land in the first mode."""
    g = wl.group(10**6)  # outside the measured stream
    prompt = {"input_ids": list(g.input_ids)} if g.input_ids is not None else {"text": g.text}
    budget = min(128, cfg.max_tokens)
    params = {"max_new_tokens": budget, "ignore_eos": True, "temperature": cfg.temperature}
    body = {**prompt, "sampling_params": params, "return_logprob": True}
    for _ in range(rounds):
        resps = await asyncio.gather(
            *(http.post("/generate", json=body) for _ in range(cfg.groups * cfg.n))
        )
        for r in resps:
            check(r, "warm-up /generate")


async def drive(
    runners: list[ModeRunner],
    cfg: BenchConfig,
    http: httpx.AsyncClient,
    info: ServerInfo,
    poller: LoadPoller,
) -> None:
    """Interleaved: step s of every mode, then (training, weight push) once for all. Otherwise
    mode after mode, each starting with an empty prefix cache, one idle push and its own
    pushes. The trainer's time after each step (training wait, push) is timed for every mode
    it stands for."""

    def version(step: int, tag: str, current: str) -> str:
        """The version of the weights that step `step` runs under (pushed before it)."""
        if cfg.step_versions:
            return str(step)
        return current if step == 0 else f"{tag}-v{step}"

    async def idle_push(group: list[ModeRunner], tag: str) -> None:
        """One push with nothing running: the baseline for the pushes between steps."""
        if not cfg.bump_version:
            return
        v = version(0, tag, group[0].version)
        seconds = await bump_version(http, info.model_path, v)
        for r in group:
            r.result.idle_push_s = seconds
            r.set_version(v)

    sync_mean: list[float] = []  # --train-s auto: sync's mean rollout seconds, once known

    def training_s(group: list[ModeRunner]) -> float:
        if not cfg.train_auto:
            return cfg.train_time
        if sync_mean:
            return sync_mean[0]
        sync = [r for r in group if r.spec.kind == "sync" and r.result.steps]
        if not sync:
            raise BenchError("--train-s auto needs the sync mode, run first")
        return sync[0].result.steps[-1].wall_s  # sync itself: its step's own rollout time

    async def between(step: int, group: list[ModeRunner], tag: str) -> None:
        t0 = time.perf_counter()
        wait = training_s(group)
        if wait > 0:
            await asyncio.sleep(wait)
        t1 = time.perf_counter()
        push: float | None = None
        if cfg.bump_version and step + 1 < cfg.steps:
            v = version(step + 1, tag, "")
            push = await bump_version(http, info.model_path, v)
            for r in group:
                r.set_version(v)
        t2 = time.perf_counter()
        for r in group:
            r.trained(t1 - t0, push, t0 - poller.t0, t2 - poller.t0)

    if cfg.interleave:
        await idle_push(runners, cfg.run_tag)
        for r in runners:
            await r.begin()
        for step in range(cfg.steps):
            for r in runners:
                if r.result.available:
                    await r.step(step, poller)
            await between(step, [r for r in runners if r.result.available], cfg.run_tag)
        return
    for r in runners:
        await flush_cache(http)
        r.set_version((await probe(http)).weight_version)
        tag = f"{cfg.run_tag}-{r.spec.slug}"
        await idle_push([r], tag)
        await forget_lengths(http)  # each mode predicts from its own rollouts only
        await r.begin()
        for step in range(cfg.steps):
            await r.step(step, poller)
            if not r.result.available:
                break
            await between(step, [r], tag)
        await r.finish(poller)  # its leftover must leave the buffer before the next mode
        if cfg.train_auto and r.spec.kind == "sync" and not sync_mean and r.result.steps:
            sync_mean.append(sum(s.wall_s for s in r.result.steps) / len(r.result.steps))


def progress_bar(total_groups: int, off: bool) -> Any:
    """A tqdm bar on stderr, or None with --no-progress or without tqdm installed (it is
    april-bench's `progress` extra: the bench runs the same without it)."""
    if off:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total_groups, unit="group", file=sys.stderr, desc="april-bench")


async def run_modes(
    url: str,
    modes: list[ModeSpec],
    cfg: BenchConfig,
    args: argparse.Namespace,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[ModeResult], dict[str, Any]]:
    """Run `modes` in order against `url` (`transport` lets a test use an in-process app)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=4096)
    timeout = httpx.Timeout(3600.0, connect=30.0)

    def client() -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, transport=transport)

    async with client() as http:
        info = await probe(http)
        if args.workload in ("natural", "text") and not info.has_tokenizer:
            raise BenchError(
                f"--workload {args.workload} needs a server with a tokenizer (--model smollm2)"
            )
        buffered = [g["group_id"] for g in await buffered_groups(http)]
        if args.clear_buffer:
            await delete_groups(http, buffered)
        elif buffered and any(m.kind != "sync" for m in modes):
            raise BenchError(
                f"the partial buffer holds {len(buffered)} group(s) (e.g. {buffered[0]!r}) that "
                "APRIL modes would resume. Use a fresh server or --clear-buffer."
            )
        wl = make_workload(args, cfg, info.vocab_size)
        await warmup(http, cfg, wl, args.warmup)
        bound: Bound | None = None
        if getattr(args, "bound_s", 0) > 0:
            print(
                f"measuring the engine's saturated throughput (~{args.bound_s:.0f} s) ...",
                file=sys.stderr,
                flush=True,
            )
            # Its own client: hundreds of connections the modes must not find in their pool
            # after the server closed them as idle (a POST on one is a read error, not retried).
            async with client() as backlog_http:
                bound = await measure_bound(
                    backlog_http, wl, cfg.max_tokens, cfg.temperature, args.bound_s, cfg.run_tag
                )
        bar = progress_bar(cfg.steps * cfg.groups * len(modes), args.no_progress)
        runners = [ModeRunner(http, m, cfg, wl, info, bar) for m in modes]
        poller = LoadPoller(http, cfg.poll_hz, time.perf_counter())
        poller.start()
        try:
            await drive([r for r in runners if r.check_available()], cfg, http, info, poller)
        finally:
            await poller.stop()
        results: list[ModeResult] = []
        for r in runners:
            results.append(await r.finish(poller))
            if bar is not None:
                bar.update(max(0, cfg.steps * cfg.groups - r.ticks))
        if bar is not None:
            bar.close()
        if bound is not None and bound.tok_s is not None:
            print("measuring the engine again, now warm ...", file=sys.stderr, flush=True)
            try:
                async with client() as backlog_http:
                    await measure_again(
                        backlog_http, wl, cfg.max_tokens, cfg.temperature, bound, cfg.run_tag
                    )
            except (BenchError, httpx.HTTPError) as exc:  # the modes' figures stand without it
                bound.stopped += f"; the second pass failed: {exc!r}"
        ledgers = [r.ledger for r in runners if r.result.available]
        cost = None
        if args.simulate:
            print("measuring the cost model for --simulate ...", file=sys.stderr, flush=True)
            model, _ = await measure_cost_model(http, info.vocab_size, info.context_len)
            cost = dataclasses.asdict(model)
    order = "interleaved" if cfg.interleave else "sequential"
    title = (
        f"april-bench ({order}) {cfg.steps} steps x {cfg.groups} groups x {cfg.n}, max "
        f"{cfg.max_tokens} tokens, over-sampling {cfg.over_sampling}, {wl.kind} workload, "
        f"seed {args.seed}"
    )
    if cfg.train_time > 0 or cfg.bump_version:
        trains = "sync's rollout time in" if cfg.train_auto else f"{cfg.train_time:g} s"
        title += (
            f"; trainer: {trains} training"
            + (" + weight push" if cfg.bump_version else "")
            + " per step"
        )
    meta = {
        "run_id": cfg.run_tag,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "title": title,
        "url": url,
        "launched": args.url is None,
        "model_path": info.model_path,
        "sglang_version": info.sglang_version,
        "workload": wl.describe(),
        "steps": cfg.steps,
        "groups": cfg.groups,
        "n": cfg.n,
        "over_sampling": cfg.over_sampling,
        "max_tokens": cfg.max_tokens,
        "train_time": "auto" if cfg.train_auto else cfg.train_time,
        "bump_version": cfg.bump_version,
        "step_versions": cfg.step_versions,
        "max_inflight": cfg.max_inflight,
        "max_staleness": cfg.max_staleness,
        "stream_sync": cfg.stream_sync,
        "poll_hz": cfg.poll_hz,
        "interleave": cfg.interleave,
        "seed": args.seed,
        "mode_checks": compare_modes(ledgers),
        "cost_model": cost,
        **({} if bound is None else bound.to_json()),
    }
    ceiling = staleness_ceiling_for(
        meta.get("bound_levels"), wl, cfg.groups * cfg.n, cfg.max_staleness, cfg.bump_version
    )
    if ceiling is not None:
        meta["staleness_ceiling"] = ceiling.to_json()
    return results, meta
