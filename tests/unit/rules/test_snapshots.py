"""The snapshot policy's pure rules: which snapshots `kv: auto` may reuse (weight version),
where a sample's snapshot lives, and what becomes of it after a segment."""

from __future__ import annotations

import pytest

from april_client.protocol import Sample, Segment
from april_server.rules import snapshots


def sample(bytes_: int, version: str | None) -> Sample:
    return Sample(
        sample_id="g/0",
        group_id="g",
        index=0,
        status="partial",
        prompt_ids=[1],
        output_ids=[2],
        output_logprobs=[0.0],
        segments=[],
        max_new_tokens=8,
        finish_reason=None,
        snapshot_bytes=bytes_,
        snapshot_weight_version=version,
    )


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
    s = sample(100, snap_v)
    assert snapshots.usable(s, current, ["a", "b"], max_staleness, allow_stale) is expected
    # none kept
    assert snapshots.usable(sample(0, current), current, [], None, allow_stale) is False


@pytest.mark.parametrize(
    ("nbytes", "interrupted", "wanted", "marked", "restored", "verdict"),
    [
        (100, True, True, True, False, "keep"),  # the snapshot asked for
        (100, True, False, True, False, "drop"),  # a later abort changed its mind
        (100, False, True, True, False, "drop"),  # the abort landed on the last token
        (None, True, True, True, False, "drop"),  # marked, none reported: free anything held
        (None, False, False, False, True, "drop"),  # finished from a restored snapshot
        (None, False, False, False, False, "none"),  # nothing was ever held
        (None, True, True, False, False, "none"),
    ],
)
def test_after_segment(
    nbytes: int | None,
    interrupted: bool,
    wanted: bool,
    marked: bool,
    restored: bool,
    verdict: str,
) -> None:
    assert snapshots.after_segment(nbytes, interrupted, wanted, marked, restored) == verdict


def test_a_snapshot_over_restored_stale_kv_stays_stale() -> None:
    """Found by review: a segment under "3" that began from a restored snapshot of "2" (stale
    reuse, in its own namespace) left a snapshot holding that KV in its prefix, tagged "3":
    the next continuation took it as current, without the caller's max_staleness, into the
    shared namespace where any request with that prefix would match old-weights KV."""
    s = sample(100, "2")
    s.segments = [Segment(0, 1, "3", "restored", "abort")]
    snapshots.record(s, 200, restored=True)
    assert s.snapshot_weight_version == "2"
    assert not snapshots.usable(s, "3", ["2", "3"], None, True)  # stale: the caller must allow it
    assert snapshots.cache_namespace(s, "3") == "april-stale/g/0"
    fresh = sample(100, "2")
    fresh.segments = [Segment(0, 1, "3", "recomputed", "abort")]
    snapshots.record(fresh, 200)  # re-prefilled under "3": all of it is "3"
    assert fresh.snapshot_weight_version == "3" and snapshots.cache_namespace(fresh, "3") is None
