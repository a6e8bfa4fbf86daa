"""`make chaos`: random clients against a real april-server, checking nothing hangs or is lost.

    python -m tests.chaos --duration-s 600 --clients 6 --mode server
    python -m tests.chaos --duration-s 600 --mode owner   # 2 engines, one killed

Several clients at random send quota calls (plain; streamed; streamed and abandoned at a random
moment; retried later with the same `request_id`), duplicate group ids, aborts (all or named,
keep snapshot/tokens/drop), deletes, resumes, prefetches (`POST /groups` into the background or
idle, some sent twice with one `request_id`), weight pushes with and without
`abort_all_requests`, and reads; calls end with `on_quota` snapshot, tokens, drop or continue,
so background generation runs between them. Agent episodes: streamed calls whose groups end
turns at stop tokens, their tool answers posted at once, twice (the second must be refused), late
(after an abort of the group let the call go on), or never (the group aborted, left awaiting);
the drain answers what still awaits. In `owner` mode an owner drives two engine servers
and one of them is killed (-9) and restarted during the run. Then everything left is drained.
The ledger (`ledger.py`) checks: no request hangs, no 5xx (an owner's 503 `no_engine`
while no engine is healthy is counted apart), every acknowledged group delivered once or
deleted/dropped, none delivered twice, every delivered sample whole, and once drained the buffer
is empty and no snapshot bytes are held. The last line says it all; the exit status is 1 on any
failed check.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from april_client._base import LIMITS
from april_server.launcher import LaunchedServer, start_all
from april_server.wire.ids import split_sample_id
from tests.chaos.ledger import ChaosLedger

R = "/april/v1"
CALL_TIMEOUT_S = 180.0  # a call on the tiny model takes seconds; past this it is a hang
READ_TIMEOUT_S = 30.0
SWEEP_WAIT_S = 90.0  # an owner frees a leaked snapshot 30-50 s after it was made
OPS = {  # operation -> weight
    "call": 20, "stream": 12, "abandon": 12, "retry": 8, "duplicate": 4, "abort": 5,
    "delete": 5, "resume": 6, "push": 3, "read": 15, "prefetch": 6, "agent": 10,
}  # fmt: skip
TURN_STOPS = 24  # turn stop token ids of an agent group: a turn of ~vocab/24 tokens
ANSWER = [11, 12, 13]


@dataclass
class Target:
    url: str
    model_path: str
    vocab_size: int = 0  # of the model (agent groups' turn stops lie in it)
    engines: list[LaunchedServer] = field(default_factory=list)
    procs: list[LaunchedServer] = field(default_factory=list)

    def restart_engine(self, i: int) -> None:
        """kill -9 engine `i` and start it again on its port and state dir."""
        old = self.engines[i]
        port, state = old.port, old.dir
        old.keep_dir = True
        if old.proc is not None:
            os.killpg(old.proc.pid, 9)
            old.proc.wait()
            old.proc = None
        new = LaunchedServer(old.extra_args, env=old.env, state_dir=state, port=port)
        new.start()
        self.engines[i] = new
        self.procs = [new if p is old else p for p in self.procs]


def launch(mode: str) -> Target:
    from april_server.cli import cpu_share_env
    from april_server.models import ensure_tiny_model

    model = str(ensure_tiny_model())
    if mode == "server":
        server = LaunchedServer()
        server.start()
        return Target(server.url, model, vocab_of(model), procs=[server])
    engines = [LaunchedServer(env=cpu_share_env(1)) for _ in range(2)]
    start_all(engines)
    owner = LaunchedServer(["--april-engines", ",".join(e.url for e in engines)])
    owner.start()
    return Target(owner.url, model, vocab_of(model), engines=engines, procs=[*engines, owner])


def vocab_of(model_path: str) -> int:
    with open(os.path.join(model_path, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def agent_spec(gid: str, rng: random.Random, vocab: int) -> dict[str, Any]:
    """An agent group: its members end turns at any of TURN_STOPS random tokens (no
    `ignore_eos`: it would make SGLang skip them), at most 3 turns."""
    stops = rng.sample(range(3, vocab), TURN_STOPS)
    params = {"temperature": 0.0, "max_new_tokens": rng.randint(20, 200)}
    return {"group_id": gid, "input_ids": [rng.randint(1, 300), rng.randint(1, 300)],
            "n": rng.randint(1, 2), "turns": {"stop_token_ids": stops, "max_turns": 3},
            "sampling_params": params}  # fmt: skip


def spec(gid: str, rng: random.Random) -> dict[str, Any]:
    n = rng.randint(1, 2)
    budgets = [int(8 * 50 ** rng.random()) for _ in range(n)]  # 8..400, long-tailed
    return {"group_id": gid, "input_ids": [rng.randint(1, 300), rng.randint(1, 300)], "n": n,
            "sampling_params": {"temperature": 0.0, "ignore_eos": True},
            "member_params": [{"max_new_tokens": b} for b in budgets]}  # fmt: skip


class Client:
    def __init__(self, k: int, target: Target, led: ChaosLedger, seed: int) -> None:
        self.k, self.target, self.led = k, target, led
        self.rng = random.Random(seed * 1000 + k)
        # Idle connections expire before the server's keep-alive closes them (april_client's).
        self.http = httpx.AsyncClient(base_url=target.url, timeout=READ_TIMEOUT_S, limits=LIMITS)
        self.pending: dict[str, dict[str, Any]] = {}  # request_id -> body of an abandoned call
        self.late: list[tuple[str, int]] = []  # (sample id, turn) to answer after its call
        self.n = 0

    async def run(self, until: float) -> None:
        names, weights = list(OPS), list(OPS.values())
        while time.monotonic() < until:
            op = self.rng.choices(names, weights)[0]
            self.led.ops[op] += 1
            try:
                await getattr(self, "op_" + op)()
            except httpx.TimeoutException as exc:
                self.led.hangs.append(f"client {self.k} {op}: {type(exc).__name__}")
            except httpx.TransportError as exc:  # the server side went away (owner mode)
                self.led.errors.append(f"client {self.k} {op}: {type(exc).__name__}: {exc}")

    def _body(self, stream: bool) -> tuple[str, dict[str, Any], list[str]]:
        self.n += 1
        rid = f"c{self.k}-{self.n}"
        gids = [f"{rid}-{i}" for i in range(self.rng.randint(0, 3))]
        # A streamed call's `done` line does not list dropped groups: drop only when plain.
        keeps = ["snapshot", "tokens", "continue"] + ([] if stream else ["drop"])
        body = {"groups": [spec(g, self.rng) for g in gids],
                "target_groups": self.rng.randint(1, 3), "on_quota": self.rng.choice(keeps),
                "stream": stream, "request_id": rid}  # fmt: skip
        return rid, body, gids

    async def _post(self, path: str, body: Any, timeout: float) -> httpx.Response:
        r = await self.http.post(path, json=body, timeout=timeout)
        self.led.status(path, r.status_code, r.text)
        return r

    async def op_call(self) -> None:
        rid, body, gids = self._body(stream=False)
        r = await self._post(R + "/rollouts", body, CALL_TIMEOUT_S)
        if r.status_code == 200:
            self.led.sent(gids, acknowledged=True, how=f"call {rid} ({body['on_quota']})")
            self.led.answered(rid, r.json())

    async def op_stream(self, abandon: bool = False) -> None:
        rid, body, gids = self._body(stream=True)
        events: list[dict[str, Any]] = []
        started = False
        try:
            async with self.http.stream(
                "POST", R + "/rollouts", json=body, timeout=CALL_TIMEOUT_S
            ) as r:
                said = "" if r.status_code < 400 else (await r.aread()).decode(errors="replace")
                self.led.status("stream", r.status_code, said)  # 503 no_engine is counted apart
                if r.status_code != 200:
                    return
                started = True
                read = self._read_events(r, events)
                await asyncio.wait_for(read, self.rng.uniform(0.0, 1.5) if abandon else None)
        except (TimeoutError, asyncio.TimeoutError):
            pass  # abandoned: leaving the block closes the connection
        finally:
            if started:
                how = f"{'abandoned' if abandon else 'streamed'} {rid} ({body['on_quota']})"
                self.led.sent(gids, acknowledged=True, how=how)
        done = [e for e in events if e["event"] == "done"]
        for e in events if not done else []:
            if e["event"] == "group_finished":  # seen, then the client left: it comes back
                gid = e["group"]["group_id"]
                self.led.story.setdefault(gid, []).append(f"streamed to {rid}, client left")
        if done:
            groups = [e["group"] for e in events if e["event"] == "group_finished"]
            self.led.answered(rid, {"batch_id": done[0]["batch_id"], "groups": groups})
        elif started:
            self.pending[rid] = {**body, "stream": False}  # its fate: ask again later
        else:
            self.led.sent(gids, acknowledged=False)

    @staticmethod
    async def _read_events(r: httpx.Response, events: list[dict[str, Any]]) -> None:
        async for line in r.aiter_lines():
            if line.strip():
                events.append(json.loads(line))

    async def op_agent(self) -> None:
        """A streamed call of agent groups: each announced member is answered at once, twice,
        late (its group aborted so the call goes on, then answered), or never (aborted)."""
        self.n += 1
        rid = f"a{self.k}-{self.n}"
        gids = [f"{rid}-{i}" for i in range(self.rng.randint(1, 3))]
        vocab = self.target.vocab_size or 512
        body = {"groups": [agent_spec(g, self.rng, vocab) for g in gids],
                "target_groups": self.rng.randint(1, len(gids)), "stream": True,
                "resume_first": False, "request_id": rid,
                "on_quota": self.rng.choice(["snapshot", "tokens", "continue"])}  # fmt: skip
        events: list[dict[str, Any]] = []
        started = False
        async with self.http.stream(
            "POST", R + "/rollouts", json=body, timeout=CALL_TIMEOUT_S
        ) as r:
            said = "" if r.status_code < 400 else (await r.aread()).decode(errors="replace")
            self.led.status("agent", r.status_code, said)
            if r.status_code != 200:
                self.led.sent(gids, acknowledged=False)
                return
            started = True
            self.led.sent(gids, acknowledged=True, how=f"agent {rid}")
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                ev = json.loads(line)
                events.append(ev)
                if ev["event"] == "sample_awaiting":
                    await self._on_awaiting(ev["sample"]["sample_id"], ev["turn"])
        done = [e for e in events if e["event"] == "done"]
        if done:
            groups = [e["group"] for e in events if e["event"] == "group_finished"]
            self.led.answered(rid, {"batch_id": done[0]["batch_id"], "groups": groups})
        elif started:
            self.pending[rid] = {**body, "stream": False}
        for sid, turn in self.late:
            await self.answer(sid, turn)
        self.late.clear()

    async def _on_awaiting(self, sid: str, turn: int) -> None:
        how = self.rng.choice(["now", "now", "twice", "late", "never"])
        self.led.ops[f"answer_{how}"] += 1
        if how in ("now", "twice"):
            await self.answer(sid, turn)
        if how == "twice":  # the same turn again: 409 not_awaiting (404 once delivered)
            await self.answer(sid, turn, again=True)
        if how in ("late", "never"):  # the call would wait for it: stop waiting first
            gid, _ = split_sample_id(sid) or (sid, -1)
            await self._post(R + "/abort", {"group_ids": [gid], "keep": "snapshot"}, CALL_TIMEOUT_S)
            if how == "late":
                self.late.append((sid, turn))

    async def answer(self, sid: str, turn: int, again: bool = False) -> None:
        """Post the tool's answer for `sid`'s `turn`; a 404 is a failure if the group is on
        the server when the client looks right after."""
        body = {"append_ids": ANSWER, "turn": turn}
        r = await self.http.post(f"{R}/samples/{sid}/input", json=body, timeout=CALL_TIMEOUT_S)
        self.led.status("input", r.status_code, r.text)
        there = False
        if r.status_code == 404:
            gid, _ = split_sample_id(sid) or (sid, -1)
            look = await self.http.get(f"{R}/partials/{gid}")
            there = look.status_code == 200
        if again and r.status_code == 200:
            self.led.errors.append(f"a second answer for {sid} turn {turn} was taken")
        self.led.answer_refused(sid, r.status_code, there)

    async def op_abandon(self) -> None:
        await self.op_stream(abandon=True)

    async def op_retry(self) -> None:
        if self.pending:
            rid = self.rng.choice(list(self.pending))
            await self.retry(rid)

    async def retry(self, rid: str) -> None:
        r = await self._post(R + "/rollouts", self.pending[rid], CALL_TIMEOUT_S)
        said = "" if r.status_code == 200 else f" {r.text[:120]}"
        for g in self.pending[rid]["groups"]:
            self.led.story.setdefault(g["group_id"], []).append(f"retry {r.status_code}{said}")
        if r.status_code == 200:
            self.led.answered(rid, r.json())
            del self.pending[rid]
        elif r.status_code in (400, 409):
            del self.pending[rid]  # too few groups now: what it handed in stays buffered

    async def buffered(self) -> list[dict[str, Any]]:
        r = await self.http.get(R + "/partials", params={"limit": 200})
        self.led.status("partials", r.status_code, r.text)
        return r.json()["groups"] if r.status_code == 200 else []

    async def op_prefetch(self) -> None:
        """`POST /groups`: hand groups in to generate in the background (or only buffer them),
        now and then sent twice with the same request_id (the second must add nothing)."""
        self.n += 1
        rid = f"p{self.k}-{self.n}"
        gids = [f"{rid}-{i}" for i in range(self.rng.randint(1, 3))]
        body = {"groups": [spec(g, self.rng) for g in gids], "request_id": rid,
                "start": self.rng.choice(["background", "background", "idle"])}  # fmt: skip
        for _ in range(2 if self.rng.random() < 0.25 else 1):
            r = await self._post(R + "/groups", body, CALL_TIMEOUT_S)
            if r.status_code == 200:
                self.led.sent(gids, acknowledged=True, how=f"prefetch {rid} ({body['start']})")

    async def op_duplicate(self) -> None:
        """A group id sent twice in one call (400), or one the server knows (409)."""
        self.n += 1
        known = [g["group_id"] for g in await self.buffered()]
        gid = self.rng.choice(known) if known and self.rng.random() < 0.5 else f"d{self.k}-{self.n}"
        groups = [spec(gid, self.rng)] * (1 if gid in known else 2)
        body = {"groups": groups, "resume_first": False, "on_quota": "tokens"}
        r = await self._post(R + "/rollouts", body, CALL_TIMEOUT_S)
        if r.status_code == 200:
            if gid not in known:  # the same id twice in one call must never be accepted
                self.led.errors.append(f"a call with {gid!r} twice was accepted")
            else:  # it was delivered meanwhile, so the id was free again: a new group
                self.led.reused.add(gid)
                self.led.sent([gid], acknowledged=True)
                self.led.answered(None, r.json())

    async def op_abort(self) -> None:
        body: dict[str, Any] = {"keep": self.rng.choice(["snapshot", "tokens", "drop"])}
        groups = await self.buffered()
        if self.rng.random() < 0.3 or not groups:
            body["all"] = True
        else:
            body["group_ids"] = [self.rng.choice(groups)["group_id"]]
        r = await self._post(R + "/abort", body, CALL_TIMEOUT_S)
        if r.status_code == 200:
            for gid in {s["group_id"] for s in r.json()["samples"]}:
                self.led.story.setdefault(gid, []).append(f"aborted (keep {body['keep']})")

    async def op_delete(self) -> None:
        groups = await self.buffered()
        if groups:
            gid = self.rng.choice(groups)["group_id"]
            r = await self.http.delete(f"{R}/partials/{gid}", timeout=CALL_TIMEOUT_S)
            self.led.status("delete", r.status_code, r.text)
            if r.status_code == 200:
                self.led.gone.add(gid)

    async def op_resume(self) -> None:
        groups = await self.buffered()
        samples = [s for g in groups for s in g["samples"] if s["status"] == "partial"]
        if samples:
            sample = self.rng.choice(samples)
            r = await self._post(
                R + "/resume", {"sample_ids": [sample["sample_id"]]}, CALL_TIMEOUT_S
            )
            self.led.story.setdefault(sample["group_id"], []).append(f"resumed: {r.status_code}")

    async def op_push(self) -> None:
        self.n += 1
        body = {"model_path": self.target.model_path, "weight_version": f"chaos-{self.k}-{self.n}",
                "abort_all_requests": self.rng.random() < 0.5}  # fmt: skip
        r = await self.http.post("/update_weights_from_disk", json=body, timeout=CALL_TIMEOUT_S)
        if r.status_code == 502 and self.target.engines:
            self.led.statuses[502] += 1  # an engine restarting missed it: it is replayed
        else:
            self.led.status("push", r.status_code, r.text)

    async def op_read(self) -> None:
        if self.rng.random() < 0.5:
            await self.buffered()
        else:
            r = await self.http.get(R + "/stats")
            self.led.status("stats", r.status_code, r.text)


async def killer(target: Target, until: float, led: ChaosLedger) -> None:
    """Owner mode: kill -9 one engine twice during the run, restarting it each time."""
    span = until - time.monotonic()
    for at in (span / 3, span / 3):
        await asyncio.sleep(at)
        led.ops["kill9"] += 1
        await asyncio.to_thread(target.restart_engine, 1)


async def settled(c: Client, timeout_s: float = 300.0) -> None:
    """Wait until no call runs (an abandoned call winds down after its client left)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        r = await c.http.get(R + "/stats")
        if r.status_code == 200 and not r.json()["active_calls"]:
            return
        await asyncio.sleep(0.5)
    c.led.hangs.append(f"calls still active {timeout_s:.0f} s after the clients stopped")


async def drain(c: Client, led: ChaosLedger) -> tuple[int, int]:
    """Resolve every abandoned call, stop everything, take every buffered group out."""
    await settled(c)
    for rid in list(c.pending):
        await c.retry(rid)
    await c._post(R + "/abort", {"all": True, "keep": "tokens"}, CALL_TIMEOUT_S)
    await settled(c)
    for _ in range(200):
        stats = (await c.http.get(R + "/stats")).json()
        left = int(stats["buffered_groups"])
        if not left:
            break
        if stats.get("awaiting_input_samples"):  # answered, so a call can take them out
            for g in await c.buffered():
                for s in g["samples"]:
                    if s["status"] == "awaiting_input":
                        await c.answer(s["sample_id"], len(s["turns"]))
        body = {"groups": [], "target_groups": min(left, 16), "on_quota": "tokens"}
        r = await c._post(R + "/rollouts", body, CALL_TIMEOUT_S)
        if r.status_code == 200:
            led.answered(None, r.json())
        else:
            await asyncio.sleep(1.0)  # e.g. no engine healthy yet
    await settled(c)
    stats = (await c.http.get(R + "/stats")).json()
    left = int(stats["buffered_groups"]) + int(stats.get("claimed_groups", 0))
    keys = ("running_samples", "awaiting_input_samples", "background_running_samples")
    led.left_over = {k: int(stats.get(k, 0) or 0) for k in keys}
    for gid in sorted(led.acknowledged - set(led.delivered) - led.gone)[:5]:
        r = await c.http.get(f"{R}/partials/{gid}")  # what the server says of a lost one
        led.story.setdefault(gid, []).append(f"now: GET /partials -> {r.status_code}")
    return left, await snapshots_after_sweep(c, led, stats)


async def snapshots_after_sweep(c: Client, led: ChaosLedger, stats: dict[str, Any]) -> int:
    """Snapshot bytes still held once the server's sweep (an owner's, `snapshot_sweep.py`)
    had the time to free what nobody refers to; the bytes held at the drain are recorded."""
    held = led.held_at_drain = int(stats.get("snapshot_bytes_used", 0) or 0)
    end = time.monotonic() + SWEEP_WAIT_S
    while held and "snapshot_sweeps" in stats and time.monotonic() < end:
        await asyncio.sleep(2.0)
        stats = (await c.http.get(R + "/stats")).json()
        held = int(stats.get("snapshot_bytes_used", 0) or 0)
    led.swept = int(stats.get("snapshots_swept", 0) or 0)
    return held


async def run(target: Target, duration_s: float, clients: int, seed: int) -> ChaosLedger:
    led = ChaosLedger()
    until = time.monotonic() + duration_s
    crowd = [Client(k, target, led, seed) for k in range(clients)]
    jobs = [c.run(until) for c in crowd]
    if target.engines:
        jobs.append(killer(target, until, led))
    await asyncio.gather(*jobs)
    for c in crowd[1:]:
        crowd[0].pending.update(c.pending)
    left, held = await drain(crowd[0], led)
    for c in crowd:
        await c.http.aclose()
    led.final = led.check(left, held, led.left_over)
    return led


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="april-chaos", description=__doc__.split("\n")[0])
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--mode", choices=["server", "owner"], default="server")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", help="an already running server (server mode only)")
    p.add_argument("--json-out", help="write the counts and failures here")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs of a pass too")
    args = p.parse_args(argv)
    if args.url:
        from april_server.models import ensure_tiny_model

        model = str(ensure_tiny_model())
        target = Target(args.url, model, vocab_of(model))
    else:
        print(f"chaos: launching ({args.mode}) ...", file=sys.stderr, flush=True)
        target = launch(args.mode)

    def keep_logs() -> None:
        for proc in target.procs:
            proc.keep_dir = True
            print(f"chaos: server log kept: {proc.log_path}", file=sys.stderr)

    try:
        led = asyncio.run(run(target, args.duration_s, args.clients, args.seed))
        if led.final or args.keep_logs:  # keep the servers' logs of a failed run
            keep_logs()
    except BaseException:  # a server gone, a harness bug: its log says why
        keep_logs()
        raise
    finally:
        for proc in target.procs:
            proc.stop()
    failed = led.final
    figures = {
        "mode": args.mode, "duration_s": args.duration_s, "clients": args.clients,
        "ops": sum(led.ops.values()), "by_op": dict(led.ops), "statuses": dict(led.statuses),
        "acknowledged": len(led.acknowledged), "delivered": len(led.delivered),
        "gone": len(led.gone), "no_engine_503": led.no_engine, "failures": failed,
        "snapshot_bytes_at_drain": led.held_at_drain, "snapshots_swept": led.swept,
        "tool_answers": dict(led.answers_taken),
    }  # fmt: skip
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(figures, f, indent=1)
    for line in failed[:20]:
        print(f"chaos: FAIL {line}", file=sys.stderr)
    verdict = "FAIL" if failed else "PASS"
    print(
        f"chaos ({args.mode}): {figures['ops']} ops by {args.clients} clients in "
        f"{args.duration_s:.0f} s, statuses {dict(sorted(led.statuses.items()))}, "
        f"{len(led.acknowledged)} groups acknowledged, {len(led.delivered)} delivered, "
        f"{len(led.gone)} deleted or dropped, "
        f"tool answers {dict(sorted(led.answers_taken.items()))}, "
        f"{len(led.hangs)} hangs, "
        f"{led.held_at_drain} snapshot bytes held at the drain ({led.swept} swept), "
        f"{len(failed)} failed checks: {verdict}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
