"""Where a sample's KV snapshot lives (engine/snapshot_places.py): the server's own record,
beside the sample's figures (size, weight version), never on the wire."""

from __future__ import annotations

from april_client.protocol import Sample, Segment
from april_server.engine.snapshot_places import SnapshotPlaces
from april_server.rules import samples as sample_rules
from april_server.rules.placement import LOCAL, Slot


def sample(sid: str = "g/0") -> Sample:
    return Sample(
        sample_id=sid,
        group_id=sid.split("/")[0],
        index=int(sid.split("/")[1]),
        status="partial",
        prompt_ids=[1],
        output_ids=[2],
        output_logprobs=[0.0],
        segments=[Segment(0, 1, "7", "fresh", engine=LOCAL, dp_rank=1)],
        max_new_tokens=8,
        finish_reason=None,
    )


def test_a_snapshot_lives_where_its_segment_ran() -> None:
    places, s = SnapshotPlaces(), sample()
    assert places.of(s) is None
    places.record(s, 640, Slot(LOCAL, 1))
    assert (s.snapshot_bytes, s.snapshot_weight_version) == (640, "7")
    assert places.of(s) == Slot(LOCAL, 1) and len(places) == 1
    places.clear(s)
    assert places.of(s) is None and s.snapshot_bytes == 0 and len(places) == 0


def test_the_place_is_not_on_the_wire() -> None:
    assert not {"snapshot_engine", "snapshot_dp_rank"} & set(Sample.__struct_fields__)


def test_figures_cleared_by_a_rule_hide_the_place_until_its_snapshot_is_freed() -> None:
    """A staleness restart clears the sample's figures (a pure rule): the place is no longer
    reported, and goes once the snapshot it names is freed."""
    places, s = SnapshotPlaces(), sample()
    places.record(s, 100, Slot("e1", 0))
    sample_rules.restart_for_staleness(s)
    assert places.of(s) is None and len(places) == 1
    places.forget(s.sample_id, Slot("e2", 0))  # another slot's: not this one
    assert len(places) == 1
    places.forget(s.sample_id, Slot("e1", 0))
    assert len(places) == 0


def test_a_sample_loaded_with_figures_but_no_place_is_on_the_local_rank() -> None:
    s = sample()
    s.snapshot_bytes = 10
    assert SnapshotPlaces().of(s) == Slot()
