"""One chaos client (`harness.py`): random operations against the target, each outcome
written to the shared ledger (`ledger.py`)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

import httpx

from april_client._base import LIMITS
from april_server.wire.ids import split_sample_id
from tests.chaos.ledger import ChaosLedger
from tests.chaos.target import Target

R = "/april/v1"
CALL_TIMEOUT_S = 180.0  # a call on the tiny model takes seconds; past this it is a hang
READ_TIMEOUT_S = 30.0
OPS = {  # operation -> weight
    "call": 20, "stream": 12, "abandon": 12, "retry": 8, "duplicate": 4, "abort": 5,
    "delete": 5, "resume": 6, "push": 3, "read": 15, "prefetch": 6, "agent": 10,
}  # fmt: skip
TURN_STOPS = 24  # turn stop token ids of an agent group: a turn of ~vocab/24 tokens
ANSWER = [11, 12, 13]


def agent_spec(gid: str, rng: random.Random, vocab: int) -> dict[str, Any]:
    """An agent group: its members end turns at any of TURN_STOPS random tokens (no
    `ignore_eos`: it would make SGLang skip them), at most 3 turns."""
    stops = rng.sample(range(3, vocab), TURN_STOPS)
    params = {"temperature": 0.0, "max_new_tokens": rng.randint(20, 200)}
    return {
        "group_id": gid,
        "input_ids": [rng.randint(1, 300), rng.randint(1, 300)],
        "n": rng.randint(1, 2),
        "turns": {"stop_token_ids": stops, "max_turns": 3},
        "sampling_params": params,
    }


def spec(gid: str, rng: random.Random) -> dict[str, Any]:
    n = rng.randint(1, 2)
    budgets = [int(8 * 50 ** rng.random()) for _ in range(n)]  # 8..400, long-tailed
    return {
        "group_id": gid,
        "input_ids": [rng.randint(1, 300), rng.randint(1, 300)],
        "n": n,
        "sampling_params": {"temperature": 0.0, "ignore_eos": True},
        "member_params": [{"max_new_tokens": b} for b in budgets],
    }


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
        body = {
            "groups": [spec(g, self.rng) for g in gids],
            "target_groups": self.rng.randint(1, 3),
            "on_quota": self.rng.choice(keeps),
            "stream": stream,
            "request_id": rid,
        }
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
        body = {
            "groups": [agent_spec(g, self.rng, vocab) for g in gids],
            "target_groups": self.rng.randint(1, len(gids)),
            "stream": True,
            "resume_first": False,
            "request_id": rid,
            "on_quota": self.rng.choice(["snapshot", "tokens", "continue"]),
        }
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
        body = {
            "groups": [spec(g, self.rng) for g in gids],
            "request_id": rid,
            "start": self.rng.choice(["background", "background", "idle"]),
        }
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
        body = {
            "model_path": self.target.model_path,
            "weight_version": f"chaos-{self.k}-{self.n}",
            "abort_all_requests": self.rng.random() < 0.5,
        }
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
