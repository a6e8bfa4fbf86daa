"""Which snapshots `kv: auto` may reuse (weight-version policy)."""

from __future__ import annotations

import pytest

from april_server.protocol import Sample
from april_server.snapshots import SnapshotPolicy
from tests.unit.fake_engine import FakeEngine


def sample(bytes_: int, version: str | None) -> Sample:
    return Sample(
        sample_id="g/0", group_id="g", index=0, status="partial", prompt_ids=[1],
        output_ids=[2], output_logprobs=[0.0], segments=[], max_new_tokens=8,
        finish_reason=None, snapshot_bytes=bytes_, snapshot_weight_version=version,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("allow_stale", "snap_v", "current", "max_staleness", "expected"),
    [
        (False, "3", "3", None, True),  # same version: always
        (False, "2", "3", 5, False),  # stale reuse not allowed by the server
        (True, "2", "3", None, False),  # allowed by the server, not asked by the caller
        (True, "2", "3", 1, True),
        (True, "1", "3", 1, False),  # two versions old
        (True, "a", "b", 1, True),  # non-numeric: order of appearance
    ],
)
def test_version_policy(
    allow_stale: bool, snap_v: str, current: str, max_staleness: int | None, expected: bool
) -> None:
    from april_server.engine_base import SnapshotEngine

    class Eng(SnapshotEngine, FakeEngine):  # only the interface matters here
        def mark_snapshot(self, rid: str, key: str) -> None: ...
        async def restore_snapshot(self, key: str) -> int:
            return 0

        async def release_snapshot(self, key: str) -> None: ...
        async def drop_snapshot(self, key: str) -> None: ...
        async def snapshot_info(self, key: str) -> None:
            return None

        async def snapshot_stats(self) -> dict[str, int]:
            return {}

    policy = SnapshotPolicy(Eng(), allow_stale)
    s = sample(100, snap_v)
    assert policy.usable(s, current, ["a", "b"], max_staleness) is expected
    assert policy.usable(sample(0, current), current, [], None) is False  # nothing kept


def test_engine_without_snapshots_disables_the_policy() -> None:
    policy = SnapshotPolicy(FakeEngine(), allow_stale=True)
    assert not policy.enabled
    assert not policy.usable(sample(100, "0"), "0", [], None)
