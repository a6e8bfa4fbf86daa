"""A seeded storm of random operations from concurrent clients against one CPU server.
Agent rollouts (#20) take part: streamed calls whose members stop at turn stops, answered at
once, twice, or left to an abort; answers to buffered members after their call ended.

Checks: no 5xx, no stuck request (every call returns within its timeout), every group ends in
exactly one place (returned once, dropped/rejected/deleted, or still buffered), the KV pool's
free tokens back at baseline, snapshot bytes equal to the live snapshots.
Size: 200 operations over 4 clients in `make test` (enough to stir every kind of operation
together), 2000 in `make test-slow`; APRIL_STORM_OPS sets the first (`make soak` runs 10000).
"""

from __future__ import annotations

import json
import os
import random
import threading
from collections import Counter
from typing import Any

import httpx
import pytest

from april_server.models import ensure_tiny_model
from april_server.wire.ids import split_sample_id
from tests.e2e.test_rollouts_e2e import R, clear_buffer, group
from tests.server_proc import ServerProc

pytestmark = pytest.mark.e2e
NUM_OPS = int(os.environ.get("APRIL_STORM_OPS", "200"))
FULL_OPS = 2000
CLIENTS = 4
SEED = int(os.environ.get("APRIL_STORM_SEED", "1234"))
# Tokens the tiny model often emits under greedy decoding: turns end within a few dozen.
TURN_STOPS = [364, 370, 385, 430, 34, 28, 17, 91, 401, 349]


class Ledger:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.created: list[str] = []
        self.returned: Counter[str] = Counter()
        self.gone: set[str] = set()  # deleted, dropped or rejected
        # Groups whose member got 404 on a repeated answer: they must have left the server.
        self.answered_after_leaving: set[str] = set()
        self.statuses: Counter[int] = Counter()
        self.errors: list[str] = []


def one_op(c: httpx.Client, rng: random.Random, k: int, who: int, led: Ledger) -> bool:
    """One random operation; False when it had nothing to act on (no call made)."""
    op = rng.choices(
        [
            "rollout",
            "rollout_snap",
            "abort",
            "resume",
            "delete",
            "bump",
            "drop_call",
            "rollout_continue",
            "prefetch",
            "agent",
            "answer",
        ],
        weights=[28, 23, 10, 14, 10, 1, 5, 10, 5, 6, 4],
    )[0]
    if op == "agent":
        return agent_call(c, rng, k, who, led)
    if op == "answer":  # a tool's answer after its call ended (or racing another's)
        parts = c.get(R + "/partials").json()["groups"]
        waiting = [s for g in parts for s in g["samples"] if s["status"] == "awaiting_input"]
        if not waiting:
            return False
        s = rng.choice(waiting)
        body = {"append_ids": [rng.randint(1, 300), 7], "turn": len(s["turns"])}
        r = c.post(f"{R}/samples/{s['sample_id']}/input", json=body)
        led.statuses[r.status_code] += 1
        if r.status_code not in (200, 404, 409):  # 404/409: deleted, answered meanwhile
            led.errors.append(f"answer {r.status_code} {r.text[:200]}")
        return True
    if op == "prefetch":  # into the background (#19): they generate between calls
        gids = [f"p{who}-{k}-{i}" for i in range(rng.randint(1, 2))]
        groups = [group(g, [rng.randint(1, 300)], [rng.randint(1, 40)]) for g in gids]
        r = c.post(
            R + "/groups", json={"groups": groups, "start": rng.choice(["background", "idle"])}
        )
        led.statuses[r.status_code] += 1
        if r.status_code == 200:
            with led.lock:
                led.created += gids
        else:
            led.errors.append(f"prefetch {r.status_code} {r.text[:200]}")
        return True
    if op.startswith("rollout") or op == "drop_call":
        gids = [f"c{who}-{k}-{i}" for i in range(rng.randint(0, 3))]
        groups = [
            group(g, [rng.randint(1, 300)], [rng.randint(1, 40) for _ in range(2)]) for g in gids
        ]
        body = {
            **new_call(c, rng, led, gids, groups),
            "on_quota": {
                "rollout": "tokens",
                "rollout_snap": "snapshot",
                "rollout_continue": "continue",
            }.get(op, "drop"),
        }
        r = c.post(R + "/rollouts", json=body)
        led.statuses[r.status_code] += 1
        if r.status_code == 200:
            with led.lock:
                for g in r.json()["groups"]:
                    led.returned[g["group_id"]] += 1
                led.gone.update(r.json()["dropped_group_ids"])
        elif r.status_code == 400 and r.json()["error"]["code"] == "invalid_target":
            with led.lock:  # another client claimed the idle groups first
                led.gone.update(gids)  # never created on the server
        else:
            led.errors.append(f"rollout {r.status_code} {r.text[:200]}")
    elif op == "abort":
        r = c.post(R + "/abort", json={"all": True, "keep": rng.choice(["tokens", "snapshot"])})
        led.statuses[r.status_code] += 1
    elif op in ("resume", "delete"):
        parts = c.get(R + "/partials").json()["groups"]
        if not parts:
            return False
        g = rng.choice(parts)
        if op == "delete":
            r = c.delete(f"{R}/partials/{g['group_id']}")
            if r.status_code == 200:
                with led.lock:
                    led.gone.add(g["group_id"])
        else:
            s = rng.choice(g["samples"])
            kv = rng.choice(["auto", "recompute"])
            r = c.post(R + "/resume", json={"sample_ids": [s["sample_id"]], "kv": kv})
        led.statuses[r.status_code] += 1
        if r.status_code not in (200, 404, 409):  # 404/409: another client got there first
            led.errors.append(f"{op} {r.status_code} {r.text[:200]}")
    elif op == "bump":
        body = {"model_path": str(ensure_tiny_model()), "weight_version": f"storm-{who}-{k}"}
        r = c.post("/update_weights_from_disk", json=body)
        led.statuses[r.status_code] += 1
    return True


def new_call(
    c: httpx.Client, rng: random.Random, led: Ledger, gids: list[str], groups: list[Any]
) -> dict[str, Any]:
    """A call's groups, counted as created, and a target within what it can reach (its own
    groups and the idle buffered ones now)."""
    with led.lock:
        led.created += gids
        idle = len(c.get(R + "/partials").json()["groups"])
    return {"groups": groups, "target_groups": max(1, min(len(gids) + idle, rng.randint(1, 3)))}


def agent_call(c: httpx.Client, rng: random.Random, k: int, who: int, led: Ledger) -> bool:
    """A streamed call of agent episodes: each awaiting member is answered at once, answered
    twice (the second must be refused), or its group is aborted (it stays awaiting)."""
    gids = [f"a{who}-{k}-{i}" for i in range(rng.randint(1, 2))]
    groups = [
        {
            "group_id": g,
            "input_ids": [rng.randint(1, 300)],
            "n": 2,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": rng.randint(8, 24)},
        }
        for g in gids
    ]
    body = {
        **new_call(c, rng, led, gids, groups),
        "on_quota": rng.choice(["tokens", "snapshot", "continue"]),
        "stream": True,
        "turns": {"stop_token_ids": TURN_STOPS, "max_turns": rng.randint(2, 3)},
    }
    with c.stream("POST", R + "/rollouts", json=body) as r:
        led.statuses[r.status_code] += 1
        if r.status_code != 200:
            r.read()
            if r.status_code == 400 and r.json()["error"]["code"] == "invalid_target":
                with led.lock:
                    led.gone.update(gids)  # never created on the server
            else:
                led.errors.append(f"agent {r.status_code} {r.text[:200]}")
            return True
        for line in r.iter_lines():
            if not line:
                continue
            ev = json.loads(line)
            if ev["event"] == "group_finished":
                with led.lock:
                    led.returned[ev["group"]["group_id"]] += 1
            elif ev["event"] == "sample_awaiting":
                how = rng.choice(["now", "now", "twice", "abort"])
                sid, turn = ev["sample"]["sample_id"], ev["turn"]
                gid, _ = split_sample_id(sid) or (sid, -1)
                if how == "abort":
                    a = c.post(R + "/abort", json={"group_ids": [gid]})
                    led.statuses[a.status_code] += 1
                    continue
                answer = {"append_ids": [rng.randint(1, 300), 7], "turn": turn}
                first = 0
                for attempt in range(2 if how == "twice" else 1):
                    a = c.post(f"{R}/samples/{sid}/input", json=answer)
                    led.statuses[a.status_code] += 1
                    first = first or a.status_code
                    # The first may race an abort-all (409 not_awaiting) or another client's
                    # resume or answer holding the group (409 group_busy): then the second may
                    # be the one taken. After a taken first, a second 409s, or 404s when the
                    # first let its group finish and a call deliver it meanwhile.
                    if attempt and a.status_code == 404:
                        with led.lock:
                            led.answered_after_leaving.add(gid)
                    elif a.status_code not in (200, 409) or (
                        attempt and first == 200 and a.status_code != 409
                    ):
                        led.errors.append(
                            f"input {attempt} {a.status_code} (first {first}) {a.text[:200]}"
                        )
    return True


@pytest.mark.parametrize(
    "num_ops",
    [pytest.param(NUM_OPS, id="quick"), pytest.param(FULL_OPS, id="full", marks=pytest.mark.slow)],
)
def test_storm(tiny_server: ServerProc, num_ops: int) -> None:
    led = Ledger()
    with tiny_server.client(timeout=120) as c:
        clear_buffer(c)
        assert c.post("/flush_cache").status_code == 200
        base = c.get(R + "/stats").json()

    def client(who: int) -> None:
        rng = random.Random(SEED * 100 + who)
        with tiny_server.client(timeout=120) as c:
            done, k = 0, 0
            while done < num_ops // CLIENTS:  # count operations that made a call
                k += 1
                try:
                    done += one_op(c, rng, k, who, led)
                except httpx.TimeoutException as exc:
                    led.errors.append(f"stuck: {exc!r}")
                    done += 1

    threads = [threading.Thread(target=client, args=(w,)) for w in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not led.errors, led.errors[:5]
    assert not [s for s in led.statuses if s >= 500], led.statuses
    with tiny_server.client(timeout=120) as c:
        # The background may still be generating: an abort stops it (and leaks nothing).
        assert c.post(R + "/abort", json={"all": True, "keep": "tokens"}).status_code == 200
        stats = c.get(R + "/stats").json()
        assert stats["running_samples"] == 0 and stats["active_calls"] == 0
        assert stats["background_groups"] == 0
        buffered = {g["group_id"]: g for g in c.get(R + "/partials").json()["groups"]}
        live_bytes = sum(s["snapshot_bytes"] for g in buffered.values() for s in g["samples"])
        assert stats["snapshot_bytes_used"] == live_bytes
        waiting = [s for g in buffered.values() for s in g["samples"]]
        waiting = [s for s in waiting if s["status"] == "awaiting_input"]
        assert stats["awaiting_input_samples"] == len(waiting)
        print(f"storm: {len(waiting)} members left awaiting input")
        # Every group in exactly one place.
        assert all(n == 1 for n in led.returned.values()), led.returned.most_common(3)
        assert not led.answered_after_leaving - set(led.returned) - led.gone
        for gid in led.created:
            places = (gid in led.returned) + (gid in led.gone) + (gid in buffered)
            assert places == 1, (gid, gid in led.returned, gid in led.gone, gid in buffered)
        # Nothing leaked from the pool: what isn't free is cached and evictable.
        assert stats["restore_locks"] == 0 and stats["protected_tokens"] == 0
        baseline = base["free_tokens"] + base["evictable_tokens"]
        assert stats["free_tokens"] + stats["evictable_tokens"] == baseline
        clear_buffer(c)
        end = c.get(R + "/stats").json()
        assert end["snapshot_bytes_used"] == 0
    calls = sum(led.statuses.values())
    assert calls >= num_ops
    print(f"storm: {calls} operations, statuses {dict(led.statuses)}")
