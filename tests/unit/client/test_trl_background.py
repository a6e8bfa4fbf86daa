"""`AprilRollout(background=True)` against a fake server: continue, prefetch, an exact ledger.

The fake keeps a buffer like the server's (calls return buffered groups first, oldest first;
`/groups` adds to it; abort + delete empty it), so the adapter's ledger can be checked against
what the server would hold after every call, and after `close()`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from april_client.protocol import Group, RolloutResp, RolloutStats, Sample, Segment
from april_client.trainer_batch import background_level, extra_groups, prefetch_groups
from april_client.trl import AprilRollout

P, N = 4, 2


def _group(spec: dict[str, Any], restarts: int = 0) -> Group:
    samples = [
        Sample(
            sample_id=f"{spec['group_id']}/{i}",
            group_id=spec["group_id"],
            index=i,
            status="completed",
            prompt_ids=spec["input_ids"],
            output_ids=[1, 2],
            output_logprobs=[-0.1, -0.1],
            segments=[Segment(start=0, end=2, weight_version="0", kv="fresh")],
            max_new_tokens=spec["sampling_params"]["max_new_tokens"],
            finish_reason="stop",
            staleness_restarts=restarts if i == 0 else 0,
        )
        for i in range(spec["n"])
    ]
    return Group(group_id=spec["group_id"], samples=samples, metadata=spec["metadata"])


class FakeServer:
    def __init__(self) -> None:
        self.buffer: dict[str, dict[str, Any]] = {}  # insertion order = age
        self.calls: list[dict[str, Any]] = []
        self.prefetches: list[dict[str, Any]] = []
        self.restarts: list[int] = []  # per call: member 0 of its first group restarted this often
        self.advice: int | None = None  # stats.groups_wanted answered

    def rollout(self, specs: list[dict[str, Any]], target: int, **kw: Any) -> RolloutResp:
        self.calls.append({"specs": specs, "target": target, **kw})
        for s in specs:
            assert s["group_id"] not in self.buffer
            self.buffer[s["group_id"]] = s
        out = [self.buffer.pop(g) for g in list(self.buffer)[:target]]
        stats = RolloutStats(
            wall_s=0.0,
            weight_version="0",
            num_finished_groups=target,
            num_buffered_groups=len(self.buffer),
            output_tokens=0,
            offpolicy_tokens=0,
            resumed_samples=0,
            restored_kv_tokens=0,
            recomputed_tokens=0,
            groups_wanted=self.advice,
        )
        k = self.restarts[len(self.calls) - 1] if len(self.calls) <= len(self.restarts) else 0
        groups = [_group(s, k if j == 0 else 0) for j, s in enumerate(out)]
        return RolloutResp(
            batch_id="b", groups=groups, buffered_group_ids=list(self.buffer), stats=stats
        )

    def add_groups(self, specs: list[dict[str, Any]], **kw: Any) -> Any:
        self.prefetches.append({"specs": specs, **kw})
        for s in specs:
            assert s["group_id"] not in self.buffer
            self.buffer[s["group_id"]] = s
        return SimpleNamespace(group_ids=[s["group_id"] for s in specs])

    def abort(self, group_ids: list[str], keep: str) -> None:
        assert keep == "drop"
        for g in group_ids:
            self.buffer.pop(g, None)

    def delete_partial(self, gid: str) -> None:
        self.buffer.pop(gid, None)


def _trainer(dataset: list[dict[str, Any]], step: int) -> Any:
    tokenizer = lambda text, add_special_tokens: {"input_ids": [len(text)]}  # noqa: E731
    return SimpleNamespace(
        model=SimpleNamespace(training=True),
        num_generations=N,
        num_generations_eval=N,
        state=SimpleNamespace(global_step=step),
        train_dataset=dataset,
        eval_dataset=None,
        processing_class=tokenizer,
        max_completion_length=64,
        temperature=1.0,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        top_k=0,
    )


def _dataset() -> list[dict[str, Any]]:
    return [{"prompt": f"p{i}", "answer": str(i % 10), "budget": 8 + i} for i in range(40)]


def _run(adapter: AprilRollout, server: FakeServer, steps: int, level: int | None = None) -> None:
    data = _dataset()
    for step in range(steps):
        prompts = [data[(step * P + g) % len(data)]["prompt"] for g in range(P) for _ in range(N)]
        out = adapter(prompts, _trainer(data, step))
        assert len(out["completion_ids"]) == P * N
        assert set(adapter.ledger.outstanding()) == set(server.buffer)  # exact, every step
        if level is not None:  # what generates while the trainer trains: the level, exactly
            assert len(server.buffer) == level, (step, len(server.buffer), level)


@pytest.mark.parametrize("target", [1, 3, 8])
@pytest.mark.parametrize("factor", [1.0, 1.5, 2.0, 3.0])
@pytest.mark.parametrize("staleness", [0, 1, 2, None])
def test_background_level_is_bounded_by_the_next_call_and_by_staleness(
    target: int, factor: float, staleness: int | None
) -> None:
    level = background_level(target, factor, staleness)
    if staleness is not None:
        # What the next `max_staleness` calls can return, P each: no more.
        assert level <= staleness * target
    if staleness != 0:
        # Enough for the next call's P, and what over-provisioning leaves anyway.
        cap = target * staleness if staleness is not None else 10**9
        assert level >= min(cap, max(target, extra_groups(target, factor, 0)))
    else:
        assert level == 0  # nothing may be generated ahead of the weights it is trained under
    for outstanding in range(3 * target):
        assert prefetch_groups(target, factor, outstanding, staleness) == max(
            0, level - outstanding
        )


@pytest.mark.parametrize(
    ("factor", "staleness"), [(1.0, 1), (2.0, 1), (3.0, 1), (3.0, 2), (2.0, None), (1.0, 0)]
)
def test_background_keeps_the_level_and_the_ledger_exact(
    factor: float, staleness: int | None
) -> None:
    server = FakeServer()
    adapter = AprilRollout(
        server,
        over_provision=factor,
        background=True,  # type: ignore[arg-type]
        push_weights=False,
        run_id="t",
        max_staleness=staleness,
    )
    level = background_level(P, factor, staleness)
    _run(adapter, server, steps=5, level=level)
    assert all(c["on_quota"] == "continue" for c in server.calls)
    for pf in server.prefetches:
        assert pf["start"] == "background" and pf["max_staleness"] == staleness
        assert pf["request_id"].startswith("t.c")
    if factor == 1.0 and staleness:
        # Without over-provisioning the call runs its own P only; P more go in right after it.
        assert [len(c["specs"]) for c in server.calls] == [P] * 5
        assert [len(pf["specs"]) for pf in server.prefetches] == [P]
    sent = [s["group_id"] for c in server.calls for s in c["specs"]]
    sent += [s["group_id"] for pf in server.prefetches for s in pf["specs"]]
    assert sorted(sent) == sorted(adapter.ledger.sent)  # every group handed in is in the ledger
    assert len(set(sent)) == len(sent)
    left = adapter.close()
    assert sorted(left) == sorted(set(adapter.ledger.sent) - set(adapter.ledger.returned))
    assert server.buffer == {} and adapter.ledger.outstanding() == []


@pytest.mark.parametrize(("factor", "staleness"), [(1.0, 1), (2.0, 1), (3.0, 1), (3.0, 2)])
def test_background_work_comes_back_within_max_staleness(factor: float, staleness: int) -> None:
    """The upper bound, on a server whose background finishes every outstanding group while
    the trainer trains: a group generates under the weights current when it was handed in
    (at a call or a prefetch) and calls return finished groups oldest first. No group comes
    back more than `max_staleness` versions old (with over-provisioning 3 and the old rule,
    2P groups finished under version s and the second P came back at s + 2)."""
    server = FakeServer()
    adapter = AprilRollout(
        server,
        over_provision=factor,
        background=True,  # type: ignore[arg-type]
        push_weights=False,
        run_id="t",
        max_staleness=staleness,
    )
    born: dict[str, int] = {}
    data = _dataset()
    for step in range(8):
        for gid in server.buffer:
            born.setdefault(gid, step - 1)  # prefetched after the last call, under its weights
        prompts = [data[(step * P + g) % len(data)]["prompt"] for g in range(P) for _ in range(N)]
        adapter(prompts, _trainer(data, step))
        for gid in adapter.records[-1].sent:
            born.setdefault(gid, step)
        lags = [step - born[gid] for gid in adapter.records[-1].returned]
        assert max(lags) <= staleness, (step, lags)
    adapter.close()


def test_prefetched_groups_are_sent_in_the_ledger_and_served_next(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The prefetch path itself (the rule's count is forced to 3: once the level is reached
    it is 0, see `prefetch_groups`): handed in with `start: background`,
    in the ledger as sent, outstanding for the next call, which draws no extras; no group is
    served twice; `close()` deletes what is left."""
    import april_client.trl as trl

    monkeypatch.setattr(trl, "prefetch_groups", lambda target, factor, outstanding, staleness: 3)
    server = FakeServer()
    adapter = AprilRollout(
        server,
        over_provision=2.0,
        background=True,  # type: ignore[arg-type]
        push_weights=False,
        run_id="t",
    )
    _run(adapter, server, steps=3)
    assert [len(pf["specs"]) for pf in server.prefetches] == [3, 3, 3]
    assert [len(c["specs"]) for c in server.calls] == [2 * P, P, P]  # extras drawn once only
    first_prefetch = [s["group_id"] for s in server.prefetches[0]["specs"]]
    assert adapter.records[0].prefetched == first_prefetch
    served = [g for r in adapter.records for g in r.returned]
    assert len(set(served)) == len(served) == 3 * P
    ids = [pf["request_id"] for pf in server.prefetches] + [c["request_id"] for c in server.calls]
    assert len(set(ids)) == len(ids)  # retries of one hand-in never collide with another's
    adapter.close()
    assert server.buffer == {} and adapter.ledger.outstanding() == []


def test_without_background_nothing_continues_or_prefetches() -> None:
    server = FakeServer()
    adapter = AprilRollout(server, over_provision=2.0, push_weights=False)  # type: ignore[arg-type]
    _run(adapter, server, steps=3)
    assert all(c["on_quota"] == "snapshot" for c in server.calls) and server.prefetches == []


def test_max_tokens_column_caps_each_group() -> None:
    server = FakeServer()
    adapter = AprilRollout(server, push_weights=False, max_tokens_column="budget")  # type: ignore[arg-type]
    _run(adapter, server, steps=1)
    for spec in server.calls[0]["specs"]:
        want = min(64, spec["metadata"]["budget"])
        assert spec["sampling_params"]["max_new_tokens"] == want
    assert {s["sampling_params"]["max_new_tokens"] for s in server.calls[0]["specs"]} != {64}


def test_restarted_samples_are_counted_and_many_warn_once(caplog: pytest.LogCaptureFixture) -> None:
    """Per step: the returned samples that had restarted for max_staleness. Once they reach
    10 % of a step's (1 of the P * N = 8 here is 12.5 %), one warning for the whole run."""
    server = FakeServer()
    server.restarts = [0, 3, 2]
    adapter = AprilRollout(server, push_weights=False, background=True)  # type: ignore[arg-type]
    with caplog.at_level("WARNING", logger="april_client.trl"):
        _run(adapter, server, steps=4)
    got = [
        (r.restarted_samples, r.staleness_restarts) for r in adapter.records if r.mode == "train"
    ]
    assert got == [(0, 0), (1, 3), (1, 2), (0, 0)]
    warned = [r.getMessage() for r in caplog.records if "max_staleness" in r.getMessage()]
    assert len(warned) == 1 and "1 of the 8 samples returned at step 1" in warned[0]


@pytest.mark.parametrize("advice", [None, 3, 7, 12])
def test_size_pool_holds_what_the_server_advised_never_less_than_over_provision(
    advice: int | None,
) -> None:
    server = FakeServer()
    server.advice = advice
    adapter = AprilRollout(
        server,
        over_provision=1.5,
        size_pool=True,  # type: ignore[arg-type]
        push_weights=False,
        run_id="t",
    )
    _run(adapter, server, steps=4)
    held = [
        len(c["specs"]) + b
        for c, b in zip(server.calls, [0, *_buffered_after(server)], strict=True)
    ]
    # The first call has no advice yet: over-provisioning's 1.5 x P; then the larger of both.
    assert held[0] == 6
    assert held[1:] == [max(6, advice or 0)] * 3
    plain = FakeServer()
    plain.advice = advice
    _run(
        AprilRollout(plain, over_provision=1.5, push_weights=False, run_id="u"),  # type: ignore[arg-type]
        plain,
        steps=4,
    )
    assert [len(c["specs"]) for c in plain.calls] == [6, 4, 4, 4]  # advice ignored when off
    with pytest.raises(ValueError, match="size_pool needs"):
        AprilRollout(server, size_pool=True, max_inflight_groups=4)  # type: ignore[arg-type]


def _buffered_after(server: FakeServer) -> list[int]:
    """Groups buffered after each call but the last (the fake returns the oldest first)."""
    out, held = [], 0
    for c in server.calls[:-1]:
        held = held + len(c["specs"]) - c["target"]
        out.append(held)
    return out
