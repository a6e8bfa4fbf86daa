"""`april-bench --agent`: sync against APRIL on a multi-turn agent workload.

Every episode runs turns: the model generates until a turn stop token, a simulated tool answers
after a long-tailed latency (asyncio sleep on the client), its token ids are appended, the model
goes on (`agent_workload.py` draws the turns, latencies and answers). Each step consumes K whole
groups of n episodes.

- `sync`: a stock-server loop (no over-provisioning, nothing buffered): the step's K x n
  episodes run concurrently, each turn a native SGLang `/generate` call with the turn stops;
  the step waits for every episode to end.
- `april`: over-provisioning (over_sampling x K groups in play) and a quota: one streamed
  `/april/v1/rollouts` call per step with `turns`, answering each `sample_awaiting` event with
  `POST /samples/{id}/input` after the tool's latency; it ends at K finished groups. Stragglers
  and members awaiting their tool stay buffered and go on in the next step (a tool that
  answers between calls is recorded; the member waits idle for the next call).

Printed per mode: consumed tokens per second of rollout wall (generated tokens of the consumed
episodes; tool tokens are not counted), the engine's idle share over that wall (1 - forward
seconds / wall, from `/stats` `engine_time`), and the time members spent awaiting input (the
turn records' `awaited_s`; sync: the tool's sleep, timed on the client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from april_server.launcher import LaunchedServer

from .agent_workload import AgentGroup, AgentSettings, AgentWorkload
from .server_api import BenchError, R, check, engine_clock, probe, rollout_events

# `--agent` defaults, and `--agent --quick` (a few minutes on a 2-core CPU with the tiny model).
DEFAULTS: dict[str, Any] = {"steps": 8, "groups": 4, "n": 4, "max_tokens": 256}
QUICK: dict[str, Any] = {"steps": 6, "groups": 4, "n": 2, "max_tokens": 160}


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("agent workload (--agent)")
    a = g.add_argument
    a(
        "--agent",
        action="store_true",
        help="multi-turn agent workload: sync vs APRIL with turns "
        "(defaults "
        + ", ".join(f"{k}={v}" for k, v in DEFAULTS.items())
        + "; with --quick "
        + ", ".join(f"{k}={v}" for k, v in QUICK.items())
        + ")",
    )
    a("--agent-max-turns", type=int, default=6, help="turns per episode at most (its p99)")
    a("--agent-turns-p50", type=float, default=2.0, help="median turns per episode")
    a("--agent-tool-p50-s", type=float, default=1.0, help="median tool latency (s)")
    a("--agent-tool-p99-s", type=float, default=8.0, help="99th percentile tool latency (s)")
    a(
        "--agent-turn-stops",
        default=None,
        metavar="ID[,ID...]",
        help="turn stop token ids (default: the tiny model's 6 most frequent tokens)",
    )


def agent_defaults(quick: bool) -> dict[str, Any]:
    return QUICK if quick else DEFAULTS


@dataclass
class Episode:
    """A consumed episode: generated tokens, turns, seconds it awaited its tool."""

    tokens: int
    turns: int
    awaited_s: float
    answered: int  # tool answers appended


@dataclass
class ModeFigures:
    mode: str
    steps: list[float] = field(default_factory=list)  # wall of each step (s)
    episodes: list[Episode] = field(default_factory=list)
    consumed_groups: int = 0
    generated_tokens: int = 0  # every token the engine generated for this mode
    engine_busy_s: float | None = None
    engine: dict[str, float] = field(default_factory=dict)  # the engine clock over the mode
    leftover_groups: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        return sum(self.steps)

    @property
    def consumed_tokens(self) -> int:
        return sum(e.tokens for e in self.episodes)

    def record(self) -> dict[str, Any]:
        answered = sum(e.answered for e in self.episodes)
        awaited = sum(e.awaited_s for e in self.episodes)
        wall = self.wall_s
        idle = None
        if self.engine_busy_s is not None and wall > 0:
            idle = round(min(1.0, max(0.0, 1.0 - self.engine_busy_s / wall)), 4)
        return {
            "mode": self.mode,
            "steps": len(self.steps),
            "consumed_groups": self.consumed_groups,
            "consumed_episodes": len(self.episodes),
            "consumed_tokens": self.consumed_tokens,
            "generated_tokens": self.generated_tokens,
            "wall_s": round(wall, 3),
            "consumed_tokens_per_s": round(self.consumed_tokens / wall, 3) if wall else None,
            "engine_busy_s": None if self.engine_busy_s is None else round(self.engine_busy_s, 3),
            "engine_idle_share": idle,
            "engine_prefill_s": self.engine.get("prefill_s"),
            "engine_decode_s": self.engine.get("decode_s"),
            "engine_prefill_tokens": self.engine.get("prefill_tokens"),
            # Running sequences per decode step: what over-provisioning is for.
            "mean_decode_batch": (
                round(self.engine["decode_tokens"] / self.engine["decode_batches"], 2)
                if self.engine.get("decode_batches")
                else None
            ),
            "awaiting_input_s": round(awaited, 3),
            "tool_answers": answered,
            "awaiting_s_per_answer": round(awaited / answered, 3) if answered else None,
            "turns_per_episode": (
                round(sum(e.turns for e in self.episodes) / len(self.episodes), 3)
                if self.episodes
                else None
            ),
            "step_walls_s": [round(s, 3) for s in self.steps],
            "leftover_groups": self.leftover_groups,
            "notes": self.notes,
        }


@dataclass
class AgentRun:
    http: httpx.AsyncClient
    wl: AgentWorkload
    groups: int  # K: groups consumed per step
    temperature: float
    tag: str

    def gid(self, mode: str, g: AgentGroup) -> str:
        return f"{self.tag}-{mode}-g{g.index:06d}"


# ---- sync: a stock server's agent loop --------------------------------------------------------


class SyncAgent:
    def __init__(self, run: AgentRun) -> None:
        self.run, self.next_index = run, 0
        self.fig = ModeFigures("sync")

    async def step(self) -> None:
        run = self.run
        groups = run.wl.groups(self.next_index, run.groups)
        self.next_index += run.groups
        t0 = time.perf_counter()
        eps = await asyncio.gather(*(self.episode(g, j) for g in groups for j in range(run.wl.s.n)))
        self.fig.steps.append(time.perf_counter() - t0)
        self.fig.episodes += eps
        self.fig.consumed_groups += len(groups)
        self.fig.generated_tokens += sum(e.tokens for e in eps)

    async def episode(self, g: AgentGroup, member: int) -> Episode:
        """Turn after turn with `/generate`: the context is prompt + everything so far."""
        wl, stops = self.run.wl, set(self.run.wl.s.turn_stop_ids)
        context, generated, turns, awaited, answered = list(g.input_ids), 0, 0, 0.0, 0
        while True:
            params = {
                **wl.sampling_params(self.run.temperature),
                "max_new_tokens": wl.s.max_tokens - generated,
                "stop_token_ids": sorted(stops),
            }
            body = {"input_ids": context, "sampling_params": params}
            out = check(await self.run.http.post("/generate", json=body), "POST /generate")
            ids = list(out["output_ids"])
            generated, turns = generated + len(ids), turns + 1
            context += ids
            reason = out["meta_info"].get("finish_reason") or {}
            at_turn_stop = reason.get("type") == "stop" and reason.get("matched") in stops
            if not at_turn_stop or turns >= g.max_turns or generated >= wl.s.max_tokens:
                return Episode(generated, turns, awaited, answered)
            t0 = time.perf_counter()
            await asyncio.sleep(wl.tool_latency(g.index, member, turns))
            context += wl.answer(g.index, member, turns)
            awaited += time.perf_counter() - t0
            answered += 1


# ---- april: over-provisioning, a quota, turns on the server ----------------------------------


class AprilAgent:
    def __init__(self, run: AgentRun, over_sampling: float, max_inflight: str) -> None:
        self.run, self.next_index = run, 0
        self.over_sampling, self.max_inflight = over_sampling, max_inflight
        self.fig = ModeFigures("april")
        self.outstanding: dict[str, AgentGroup] = {}  # sent, not consumed yet
        self.tools: dict[tuple[str, int], asyncio.Task[None]] = {}  # (sample, turn) -> tool
        self.conflicts = 0

    @property
    def want(self) -> int:
        return max(self.run.groups, math.ceil(self.over_sampling * self.run.groups))

    def spec(self, g: AgentGroup) -> dict[str, Any]:
        wl = self.run.wl
        return {
            "group_id": self.run.gid("april", g),
            "input_ids": list(g.input_ids),
            "n": wl.s.n,
            "sampling_params": wl.sampling_params(self.run.temperature),
            "turns": wl.turns(g),
        }

    async def step(self, step: int) -> None:
        run = self.run
        new = run.wl.groups(self.next_index, max(0, self.want - len(self.outstanding)))
        self.next_index += len(new)
        for g in new:
            self.outstanding[run.gid("april", g)] = g
        total = len(self.outstanding)
        body = {
            "groups": [self.spec(g) for g in new],
            "target_groups": run.groups,
            "resume_first": True,
            "on_quota": "snapshot",
            "max_inflight_groups": total
            if self.max_inflight == "all"
            else (self.max_inflight if self.max_inflight == "auto" else int(self.max_inflight)),
            "stream": True,
            "request_id": f"{run.tag}-april-s{step}",
            # Declares turns for the call too, so that it waits for answers even in a step
            # that sends no new group (every group carries its own `max_turns`).
            "turns": {"stop_token_ids": list(run.wl.s.turn_stop_ids)},
        }
        t0 = time.perf_counter()
        done: dict[str, Any] | None = None
        async for ev in rollout_events(run.http, body):
            if ev["event"] == "sample_awaiting":
                self.answer_later(ev["sample"], int(ev["turn"]))
            elif ev["event"] == "group_finished":
                self.consume(ev["group"])
            elif ev["event"] == "done":
                done = ev
        self.fig.steps.append(time.perf_counter() - t0)
        if done is None:
            raise BenchError("the rollout stream ended without its done event")
        self.fig.generated_tokens += int(done["stats"].get("output_tokens", 0))

    def answer_later(self, sample: dict[str, Any], turn: int) -> None:
        """Run the tool for this turn once: a member resumed by a later call while still
        awaiting may be announced again."""
        key = (sample["sample_id"], turn)
        if key in self.tools:
            return
        g = self.outstanding[sample["group_id"]]
        self.tools[key] = asyncio.get_running_loop().create_task(
            self.tool(sample["sample_id"], g, int(sample["index"]), turn)
        )

    async def tool(self, sample_id: str, g: AgentGroup, member: int, turn: int) -> None:
        wl = self.run.wl
        await asyncio.sleep(wl.tool_latency(g.index, member, turn))
        body = {"append_ids": wl.answer(g.index, member, turn), "turn": turn}
        resp = await self.run.http.post(f"{R}/samples/{sample_id}/input", json=body)
        if resp.status_code == 409:
            self.conflicts += 1  # not awaiting: must not happen, reported as a note
        else:
            check(resp, f"POST samples/{sample_id}/input")

    def consume(self, group: dict[str, Any]) -> None:
        self.outstanding.pop(group["group_id"], None)
        self.fig.consumed_groups += 1
        for s in group["samples"]:
            turns = s.get("turns") or []
            self.fig.episodes.append(
                Episode(
                    tokens=len(s["output_ids"]),
                    turns=len(turns),
                    awaited_s=sum(t.get("awaited_s") or 0.0 for t in turns),
                    answered=len(s.get("appended") or []),
                )
            )

    async def close(self) -> None:
        """Stop the tools still running, report and free what is left on the server."""
        for task in self.tools.values():
            task.cancel()
        await asyncio.gather(*self.tools.values(), return_exceptions=True)
        for task in self.tools.values():
            if not task.cancelled() and task.exception() is not None:
                self.fig.notes.append(f"a tool answer failed: {task.exception()}")
        if self.conflicts:
            self.fig.notes.append(f"{self.conflicts} tool answers were refused (409)")
        left = sorted(self.outstanding)
        self.fig.leftover_groups = len(left)
        if left:
            body = {"group_ids": left, "keep": "drop"}
            check(await self.run.http.post(R + "/abort", json=body), "POST /abort")
            for gid in left:
                r = await self.run.http.delete(f"{R}/partials/{gid}")
                if r.status_code not in (200, 404):
                    check(r, f"DELETE partials/{gid}")


# ---- the session -----------------------------------------------------------------------------


def settings(args: argparse.Namespace, vocab: int) -> AgentSettings:
    stops = AgentSettings.turn_stop_ids
    if args.agent_turn_stops:
        stops = tuple(int(x) for x in args.agent_turn_stops.split(","))
    return AgentSettings(
        n=args.n,
        max_tokens=args.max_tokens,
        max_turns=args.agent_max_turns,
        turns_p50=args.agent_turns_p50,
        tool_p50_s=args.agent_tool_p50_s,
        tool_p99_s=args.agent_tool_p99_s,
        turn_stop_ids=stops,
        seed=args.seed,
        vocab_size=vocab,
    )


async def measure_mode(
    http: httpx.AsyncClient, runner: SyncAgent | AprilAgent, steps: int, progress: bool
) -> ModeFigures:
    clock0 = await engine_clock(http)
    for step in range(steps):
        await (runner.step() if isinstance(runner, SyncAgent) else runner.step(step))
        if progress:
            print(
                f"  {runner.fig.mode} step {step + 1}/{steps}: {runner.fig.steps[-1]:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    clock1 = await engine_clock(http)
    if clock0 and clock1:
        delta = {k: round(v - clock0.get(k, 0.0), 6) for k, v in clock1.items()}
        runner.fig.engine = delta
        runner.fig.engine_busy_s = delta.get("prefill_s", 0.0) + delta.get("decode_s", 0.0)
    if isinstance(runner, AprilAgent):
        await runner.close()
    return runner.fig


async def session(url: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
    timeout = httpx.Timeout(3600.0, connect=30.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        info = await probe(http)
        wl = AgentWorkload(settings(args, info.vocab_size))
        run = AgentRun(http, wl, args.groups, args.temperature, f"agent{uuid.uuid4().hex[:6]}")
        for _ in range(args.warmup):  # first-call costs stay out of the first mode
            body = {
                "input_ids": list(wl.group(10**6).input_ids),
                "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
            }
            for r in await asyncio.gather(*(http.post("/generate", json=body) for _ in range(4))):
                check(r, "warm-up /generate")
        progress = not args.no_progress
        figs = [await measure_mode(http, SyncAgent(run), args.steps, progress)]
        april = AprilAgent(run, args.over_sampling, args.max_inflight)
        figs.append(await measure_mode(http, april, args.steps, progress))
    title = (
        f"april-bench --agent: {args.steps} steps x {args.groups} groups x {args.n} episodes, "
        f"over-sampling {args.over_sampling} (april), seed {args.seed}\n{wl.describe()}"
    )
    return [f.record() for f in figs], title


def table(recs: list[dict[str, Any]]) -> str:
    cols = [
        ("mode", "mode", "s"),
        ("consumed tok/s", "consumed_tokens_per_s", ".2f"),
        ("engine idle", "engine_idle_share", "pct"),
        ("decode batch", "mean_decode_batch", ".2f"),
        ("awaiting s", "awaiting_input_s", ".1f"),
        ("s/answer", "awaiting_s_per_answer", ".2f"),
        ("answers", "tool_answers", "d"),
        ("turns/ep", "turns_per_episode", ".2f"),
        ("consumed tok", "consumed_tokens", "d"),
        ("wall s", "wall_s", ".1f"),
        ("generated tok", "generated_tokens", "d"),
        ("leftover groups", "leftover_groups", "d"),
    ]

    def cell(v: Any, spec: str) -> str:
        if v is None:
            return "n/a"
        return f"{100 * v:.1f}%" if spec == "pct" else format(v, spec)

    rows = [[h for h, _, _ in cols]] + [[cell(r.get(k), s) for _, k, s in cols] for r in recs]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    by = {r["mode"]: r for r in recs}
    sync, april = by.get("sync"), by.get("april")
    if sync and april and sync["consumed_tokens_per_s"] and april["consumed_tokens_per_s"]:
        ratio = april["consumed_tokens_per_s"] / sync["consumed_tokens_per_s"]
        lines.append(f"april vs sync: x{ratio:.2f} consumed tokens per second")
    for r in recs:
        lines += [f"{r['mode']}: {note}" for note in r["notes"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    server: LaunchedServer | None = None
    t0 = time.perf_counter()
    try:
        url = args.url
        if url is None:
            server = LaunchedServer(["--april-model", args.model, *args.server_arg])
            print(f"launching april-server on {server.url} ...", file=sys.stderr, flush=True)
            server.start()
            url = server.url
        recs, title = asyncio.run(session(url, args))
    except BenchError as exc:
        print(f"april-bench: {exc}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
    print(f"\n{title}")
    print(table(recs))
    print(f"total time {time.perf_counter() - t0:.0f}s (server start-up included)")
    if args.json_out:
        write(args.json_out, recs, title)
        print(f"wrote {args.json_out}")
    return 0 if all(not r["notes"] for r in recs) else 1


def write(path: Path, recs: list[dict[str, Any]], title: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for r in recs:
            f.write(json.dumps({**r, "title": title}) + "\n")
