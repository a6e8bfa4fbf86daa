"""The composition root's own views (`root/manager.py`): `/stats`, counted from the index and
the parts without reading the buffer, and `check_integrity()`, which holds between any two
callbacks and fails on a broken invariant. Fake engine, real SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from april_client.protocol import GroupSpec, RolloutReq
from april_server.buffer.store import BufferStore
from april_server.buffer.synthetic import fill
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from tests.unit.fake_engine import FakeEngine
from tests.unit.waiting import until


def long_group(gid: str, budget: int = 400, n: int = 2) -> GroupSpec:
    params = {"max_new_tokens": budget, "ignore_eos": True, "temperature": 0.0}
    return GroupSpec(gid, n=n, input_ids=[1, 2, 3], sampling_params=params)


def test_stats_follow_a_call_from_running_to_buffered(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        groups = [long_group("quick", 40), long_group("slow")]
        call = asyncio.create_task(
            mgr.rollout(RolloutReq(groups=groups, target_groups=1, on_quota="tokens"))
        )
        during = await mgr.stats()
        while during["running_samples"] == 0:
            await asyncio.sleep(0.001)
            during = await mgr.stats()
        assert during["active_calls"] == 1 and during["claimed_groups"] >= 1
        assert 1 <= during["running_samples"] <= 4
        r = await call
        after = await mgr.stats()
        held = (after["active_calls"], after["claimed_groups"], after["running_samples"])
        assert held == (0, 0, 0)
        assert r.buffered_group_ids == ["slow"]
        assert (after["buffered_groups"], after["buffered_samples"]) == (1, 2)
        assert after["buffered_unfinished_groups"] == 1
        slow = await mgr.buffer.read_group("slow")
        assert after["buffered_output_tokens"] == sum(len(s.output_ids) for s in slow.samples)

    asyncio.run(go())


def test_integrity_catches_a_sample_whose_logprobs_and_tokens_disagree(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        call = asyncio.create_task(mgr.rollout(RolloutReq(groups=[long_group("g")])))
        await until(lambda: "g" in mgr.buffer.claimed)
        mgr.check_integrity()
        sample = mgr.buffer.claimed["g"].samples[0]
        sample.output_logprobs.append(0.0)  # no await until it is undone: nothing else runs
        with pytest.raises(AssertionError, match=sample.sample_id):
            mgr.check_integrity()
        sample.output_logprobs.pop()
        mgr.check_integrity()
        await call
        mgr.check_integrity()

    asyncio.run(go())


def test_integrity_catches_tokens_that_no_segment_accounts_for(tmp_path: Path) -> None:
    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        call = asyncio.create_task(mgr.rollout(RolloutReq(groups=[long_group("g")])))
        await until(lambda: "g" in mgr.buffer.claimed)
        sample = mgr.buffer.claimed["g"].samples[0]
        sample.output_ids.append(7)
        sample.output_logprobs.append(0.0)
        with pytest.raises(AssertionError, match=sample.sample_id):
            mgr.check_integrity()
        sample.output_ids.pop()
        sample.output_logprobs.pop()
        await call
        mgr.check_integrity()

    asyncio.run(go())


def test_integrity_catches_a_stored_group_that_is_neither_idle_nor_held(tmp_path: Path) -> None:
    store = BufferStore(tmp_path / "b.sqlite")
    fill(store, 3, n=2, output_len=4)
    mgr = RolloutManager(FakeEngine(vocab=256), Durable.load(store))
    mgr.check_integrity()  # what it loaded at start is idle, and the store agrees
    fill(store, 1, prefix="stray", seed=1, n=2, output_len=4)  # behind the buffer's back
    with pytest.raises(AssertionError, match="stray-0"):
        mgr.check_integrity()


def test_stats_count_the_buffer_without_listing_it(tmp_path: Path) -> None:
    st = BufferStore(tmp_path / "b.sqlite")
    fill(st, 300, n=4, output_len=8)
    mgr = RolloutManager(FakeEngine(vocab=256), Durable.load(st))
    calls: list[list[str]] = []
    real = st.read_groups

    async def spy(ids: list[str]) -> Any:
        calls.append(ids)
        return await real(ids)

    st.read_groups = spy  # type: ignore[method-assign]
    stats = asyncio.run(mgr.stats())
    assert (stats["buffered_groups"], stats["buffered_samples"]) == (300, 1200)
    assert stats["buffered_output_tokens"] == 1200 * 8
    assert calls == []  # no body was read
