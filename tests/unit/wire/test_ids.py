"""Sample ids (`wire/ids.py`): one spelling names one member; any other spelling is a 404 on
every route that names a sample, before anything acts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from april_server.root.durable import Durable
from april_server.root.manager import RolloutManager
from april_server.wire.errors import ApiError
from tests.unit.fake_engine import FakeEngine
from tests.unit.group_specs import buffered


def test_a_sample_id_names_one_member_in_one_spelling(tmp_path: Path) -> None:
    """Found by review: indexes were read with `isdigit()` and `int()`, so "g/01" aliased
    "g/1" (a resume naming both started the member, then failed on its alias and released
    the group while the segment kept generating; an abort of "g/01" stopped nothing) and
    "g/²" crashed with a 500 after an abort had already acted. Now both are 404."""
    from april_client.protocol import AbortReq, InputReq, ResumeReq
    from april_server.wire.ids import split_sample_id

    assert split_sample_id("g/0") == ("g", 0) and split_sample_id("a/b/12") == ("a/b", 12)
    assert [split_sample_id(s) for s in ("g/01", "g/²", "g/", "g", "/1", "g/-1")] == [None] * 6

    async def go() -> None:
        mgr = RolloutManager(FakeEngine(delay_s=0.002), Durable.open(tmp_path / "b.sqlite"))
        await buffered(mgr, ["g"])
        for bad in (["g/0", "g/00"], ["g/²"]):
            with pytest.raises(ApiError) as exc:
                await mgr.resume(ResumeReq(sample_ids=bad))
            assert exc.value.status == 404, bad
        with pytest.raises(ApiError) as exc:
            await mgr.abort(AbortReq(sample_ids=["g/²"]))
        assert exc.value.status == 404
        with pytest.raises(ApiError) as exc:
            await mgr.post_input("g/²", InputReq(append_ids=[1]))
        assert exc.value.status == 404
        assert not mgr.segments.running and mgr.buffer.owner_of("g") is None
        mgr.check_integrity()

    asyncio.run(go())
