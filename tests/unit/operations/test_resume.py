"""`POST /resume` (`operations/resume.py`): a named sample continues now with what is appended,
up to its budget; one that cannot resume is refused, and a refusal leaves nothing held. Fake
engine."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from april_client.protocol import ResumeReq, RolloutReq
from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.rules.samples import context_ids
from april_server.wire.errors import ApiError
from tests.unit.calls.test_rollout import make, spec
from tests.unit.fake_engine import FakeEngine


def test_resume_append_ids_and_budget() -> None:
    async def go() -> None:
        mgr = make()
        await mgr.rollout(
            RolloutReq(groups=[spec("a", 1, [3]), spec("b", 1, [400])], target_groups=1)
        )
        s = (await mgr.buffer.read_samples(["b/0"]))["b/0"]
        done_before = len(s.output_ids)
        out = await mgr.resume(ResumeReq(sample_ids=["b/0"], append_ids={"b/0": [7, 7]}))
        s = out[0]
        assert s.status == "truncated" and len(s.output_ids) == 400
        assert s.appended[0].at == done_before and s.appended[0].ids == [7, 7]
        assert s.segments[-1].kv == "recomputed"
        # the continuation saw prompt + output + appended tokens
        last_input = mgr.engine.calls[-1][1]  # type: ignore[attr-defined]
        assert last_input == context_ids(s)[: len(last_input)]
        with pytest.raises(ApiError) as e:
            await mgr.resume(ResumeReq(sample_ids=["b/0"]))
        assert e.value.status == 409
        with pytest.raises(ApiError) as e:
            await mgr.resume(ResumeReq(sample_ids=["nope/0"]))
        assert e.value.status == 404

    asyncio.run(go())


def test_cancelled_api_error_leaves_nothing_claimed(tmp_path: Path) -> None:
    mgr = RolloutManager(FakeEngine(), Durable.open(None))
    with pytest.raises(ApiError):
        asyncio.run(mgr.resume(msgspec.convert({"sample_ids": ["nope/0"]}, ResumeReq)))
    assert mgr.buffer.holders == {}
