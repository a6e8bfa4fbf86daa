"""Property test of the background (#19): random interleavings of calls (`continue` and the
rest), prefetches, aborts, deletes and weight updates, run concurrently over the fake engine.
Whatever the order: no group is lost or delivered twice, no sample generates in two places at
once, every delivered sample equals the uninterrupted run of its context, and the bookkeeping
is consistent once everything has settled."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april_client.protocol import AbortReq, GroupSpec, GroupsReq, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine, next_token
from tests.unit.idle import idle_bodies

OPS = st.lists(
    st.tuples(
        st.sampled_from(["call_continue", "call_tokens", "prefetch", "abort", "delete", "push"]),
        st.integers(1, 3),  # how many groups / the target
        st.integers(5, 120),  # a budget
        st.floats(0.0, 0.05),  # a pause before it
    ),
    min_size=3,
    max_size=10,
)


def spec(gid: str, budget: int) -> GroupSpec:
    params = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 0.0}
    return GroupSpec(gid, input_ids=[7, 8], sampling_params=params)


def uninterrupted(prompt: list[int], budget: int) -> list[int]:
    ctx, out = list(prompt), []
    for _ in range(budget):
        out.append(next_token(ctx, 64))
        ctx.append(out[-1])
    return out


class Watch(FakeEngine):
    """Fails the test if a sample ever has two requests at once."""

    def __init__(self) -> None:
        super().__init__(delay_s=0.001)
        self.live: dict[str, str] = {}
        self.double: list[str] = []

    async def generate(self, rid: str, ids: list[int], params: dict[str, Any]) -> Any:
        sid = rid.partition("@")[0]
        if sid in self.live:
            self.double.append(sid)
        self.live[sid] = rid
        try:
            return await super().generate(rid, ids, params)
        finally:
            if self.live.get(sid) == rid:
                del self.live[sid]


@settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(ops=OPS)
def test_background_interleavings_lose_nothing(tmp_path_factory: Any, ops: list[Any]) -> None:
    path: Path = tmp_path_factory.mktemp("bg") / "b.sqlite"

    async def go() -> None:
        eng = Watch()
        mgr = RolloutManager(eng, Durable.open(path))
        created: set[str] = set()
        delivered: list[str] = []
        gone: set[str] = set()
        budgets: dict[str, int] = {}
        bodies: list[Any] = []

        async def one(k: int, op: str, n: int, budget: int, pause: float) -> None:
            await asyncio.sleep(pause)
            gids = [f"o{k}-{i}" for i in range(n)]
            try:
                if op.startswith("call"):
                    groups = [spec(g, budget) for g in gids]
                    on_quota = "continue" if op == "call_continue" else "tokens"
                    created.update(gids)
                    budgets.update(dict.fromkeys(gids, budget))
                    r = await mgr.rollout(
                        RolloutReq(groups=groups, target_groups=1, on_quota=on_quota)
                    )
                    delivered.extend(g.group_id for g in r.groups)
                    bodies.extend(r.groups)
                elif op == "prefetch":
                    created.update(gids)
                    budgets.update(dict.fromkeys(gids, budget))
                    await mgr.add_groups(GroupsReq(groups=[spec(g, budget) for g in gids]))
                elif op == "abort":
                    await mgr.abort(AbortReq(all=True, keep="tokens"))
                elif op == "delete" and len(mgr.buffer.idle):
                    gid = next(iter(mgr.buffer.idle.oldest())).group_id
                    await mgr.delete(gid)
                    gone.add(gid)
                elif op == "push":
                    await mgr.segments.weight_cut.before_update()
                    await asyncio.sleep(0.01)
                    eng.version = str(int(eng.version) + 1)
                    mgr.segments.weight_cut.after_update()
            except ApiError as exc:
                # Ids are unique and targets never exceed what a call sends: only a delete
                # that raced a call (it holds the group, or delivered it) may be refused.
                assert op == "delete" and exc.code in ("group_busy", "not_found"), exc
            mgr.check_integrity()  # after every operation, not only at the end

        await asyncio.gather(*(one(k, *op) for k, op in enumerate(ops)))
        await mgr.abort(AbortReq(all=True, keep="tokens"))  # settle the background
        assert not mgr.segments.running and not eng.double, eng.double
        assert len(delivered) == len(set(delivered)), "a group was delivered twice"
        buffered = {e.group_id for e in mgr.buffer.idle.oldest()}
        assert not set(delivered) & buffered and not gone & buffered
        assert set(delivered) | buffered | gone == created
        for g in [*idle_bodies(mgr.buffer), *bodies]:
            for s in g.samples:  # every kept token is the uninterrupted run's
                assert (
                    s.output_ids
                    == uninterrupted(s.prompt_ids, budgets[g.group_id])[: len(s.output_ids)]
                )
                assert sum(x.end - x.start for x in s.segments) == len(s.output_ids)
        mgr.check_integrity()
        mgr.store.close()

    asyncio.run(go())
