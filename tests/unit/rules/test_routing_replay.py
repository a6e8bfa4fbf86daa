"""Routing replay across segments (rules/routing_replay.py), against a model of what SGLang returns.

The fake model routes position p under weight version v to `truth(p, v)`. A segment is either
restored from a snapshot (SGLang is asked from the restore point, nothing before it recomputed)
or re-prefilled (asked from 0; positions past the prefix-cache hit are recomputed). Whatever
the interruptions, the recorded row of every position must be the one of the version that first
computed it, and `recomputed` must hold exactly the newest recomputation of each position.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from april_client import routed_experts as decode
from april_client.protocol import GroupSpec, Routing, Sample
from april_server.rules import routing_replay as routing
from april_server.rules import samples

LAYERS, TOP_K = 2, 2
ROW = routing.row_bytes(LAYERS, TOP_K, "uint8")


def truth(p: int, version: int) -> bytes:
    return bytes((p * 5 + version * 3 + i) % 8 for i in range(ROW))


def sample(prompt_len: int = 5, budget: int = 200) -> Sample:
    spec = GroupSpec(group_id="g", input_ids=list(range(prompt_len)), return_routed_experts=True)
    spec = msgspec.structs.replace(spec, sampling_params={"max_new_tokens": budget})
    return samples.build_group(spec, spec.input_ids or [], 4096, None).samples[0]


def run_segment(s: Sample, new: int, start: int, cached: int, version: int) -> None:
    """What SGLang answers a request for `s`'s context + `new` tokens, rows from `start`."""
    fed_after = len(samples.context_ids(s)) + new - 1
    rows = b"".join(truth(p, version) for p in range(start, fed_after))
    result = samples.SegmentResult(
        output_ids=[7] * new,
        output_logprobs=[0.0] * new,
        finish_reason="abort",
        weight_version=str(version),
        cached_tokens=cached,
        routing_asked=start,
        routing=routing.RoutingRows(start, rows, LAYERS, TOP_K, "uint8"),
    )
    samples.apply_segment(s, result, "recomputed")


def test_one_uninterrupted_segment_records_every_fed_position() -> None:
    s = sample()
    run_segment(s, new=4, start=0, cached=0, version=0)
    r = s.routing
    assert r is not None and r.num_positions == 5 + 4 - 1  # the newest token is not fed yet
    assert r.experts == b"".join(truth(p, 0) for p in range(8))
    assert [(x.start, x.end, x.segment) for x in r.spans] == [(0, 8, 0)]
    assert decode.experts(r).shape == (8, LAYERS, TOP_K)


def test_not_asked_records_nothing() -> None:
    s = sample()
    s.return_routed_experts = False
    run_segment(s, new=4, start=0, cached=0, version=0)
    assert s.routing is None


def test_missing_rows_are_flagged_and_filled() -> None:
    s = sample()
    run_segment(s, new=3, start=0, cached=0, version=0)
    result = samples.SegmentResult([7, 7], [0.0, 0.0], "abort", "1", routing_asked=0, routing=None)
    samples.apply_segment(s, result, "recomputed")
    r = s.routing
    assert r is not None and r.num_positions == 5 + 5 - 1
    assert r.spans[-1].missing and (r.spans[-1].start, r.spans[-1].end) == (7, 9)
    assert (decode.experts(r)[7:] == decode.MISSING).all()


def test_reset_forgets_routing_but_keeps_the_setting() -> None:
    s = sample()
    run_segment(s, new=3, start=0, cached=0, version=0)
    samples.reset_output(s)
    assert s.routing is None and s.return_routed_experts


@settings(max_examples=300, deadline=None)
@given(
    prompt_len=st.integers(1, 12),
    plan=st.lists(
        st.tuples(
            st.integers(0, 9),  # new tokens
            st.booleans(),  # restored (else re-prefilled)
            st.integers(0, 100),  # prefix-cache hit of a re-prefill, as a share of the known rows
            st.booleans(),  # weights pushed before this segment
        ),
        min_size=1,
        max_size=8,
    ),
)
def test_interruptions_keep_first_routing_and_flag_recomputation(
    prompt_len: int, plan: list[tuple[int, bool, int, bool]]
) -> None:
    s = sample(prompt_len)
    version = 0
    first: dict[int, int] = {}  # position -> the version that first computed it
    newest_recompute: dict[int, int] = {}
    for i, (new, restored, hit, push) in enumerate(plan):
        version += push
        known = 0 if s.routing is None else s.routing.num_positions
        fed_after = len(samples.context_ids(s)) + new - 1
        if i > 0 and restored:
            start = cached = known  # a snapshot covers every fed position
        else:
            start, cached = 0, known * hit // 100
        for p in range(cached, known):
            newest_recompute[p] = version
        for p in range(max(known, start), fed_after):
            first.setdefault(p, version)
        run_segment(s, new, start, cached, version)
    r = s.routing
    assert r is not None
    assert r.num_positions == len(first) == len(samples.context_ids(s)) - 1
    assert r.experts == b"".join(truth(p, first[p]) for p in range(r.num_positions))
    assert decode.versions(r) == [str(first[p]) for p in range(r.num_positions)]
    rows, mask = decode.recomputed(r)
    assert set(np.flatnonzero(mask).tolist()) == set(newest_recompute)
    for p, v in newest_recompute.items():
        assert rows[p].tobytes() == np.frombuffer(truth(p, v), np.uint8).astype(np.int16).tobytes()
    bounds = [0] + [b for x in r.spans for b in (x.start, x.end)] + [r.num_positions]
    assert bounds == sorted(bounds) and all(
        a == b for a, b in zip(bounds[::2], bounds[1::2], strict=True)
    )


def test_routing_round_trips_through_json_and_msgpack() -> None:
    s = sample()
    run_segment(s, new=4, start=0, cached=0, version=0)
    run_segment(s, new=2, start=0, cached=3, version=1)
    for enc, dec in (
        (msgspec.json.encode, msgspec.json.decode),
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
    ):
        back = dec(enc(s), type=Sample)
        assert back.routing == s.routing
    body = msgspec.json.decode(msgspec.json.encode(s.routing))
    assert isinstance(body["experts"], str)  # base64 in JSON
    assert msgspec.convert(body, Routing) == s.routing


def test_asking_routing_of_a_dense_model_is_a_400() -> None:
    from april_server.wire.errors import ApiError

    with pytest.raises(ApiError) as err:
        routing.check_wanted(True, None, "group 'g'")
    assert err.value.status == 400
    routing.check_wanted(True, (2, 2, "uint8"), "group 'g'")
    routing.check_wanted(False, None, "group 'g'")


def test_routing_crosses_the_owner_engine_wire() -> None:
    """An owner sends a segment's `routing_start` and gets its rows back (fleet/engine_wire.py)."""
    from april_server.engine.base import SegmentCall, SegmentOutcome
    from april_server.fleet.engine_wire import (
        EngineInfo,
        encoder,
        engine_info,
        segment_call,
        segment_outcome,
    )
    from april_server.rules.placement import Slot

    call = SegmentCall("r", "g/0", [1, 2], {"max_new_tokens": 3}, Slot("e:1", 0), routing_start=0)
    assert segment_call.decode(encoder.encode(call)) == call
    rows = routing.RoutingRows(4, bytes(range(8)), LAYERS, TOP_K, "uint8")
    res = samples.SegmentResult([1], [0.0], "abort", "v", routing_asked=4, routing=rows)
    out = SegmentOutcome(res, Slot("e:1", 0))
    assert segment_outcome.decode(encoder.encode(out)) == out
    info = EngineInfo(8, 448, 1, "v", False, True, routing_format=(LAYERS, TOP_K, "uint8"))
    assert engine_info.decode(encoder.encode(info)).routing_format == (LAYERS, TOP_K, "uint8")


def test_turned_on_mid_way_a_restore_marks_the_unrecorded_prefix_missing() -> None:
    s = sample()
    s.return_routed_experts = False
    run_segment(s, new=4, start=0, cached=0, version=0)  # 8 positions fed, none recorded
    s.return_routed_experts = True  # /resume return_routed_experts: true
    run_segment(s, new=3, start=8, cached=8, version=0)  # restored: asked from the restore
    r = s.routing
    assert r is not None and r.num_positions == 5 + 7 - 1
    assert [(x.start, x.end, x.missing) for x in r.spans] == [(0, 8, True), (8, 11, False)]
    got = decode.experts(r)
    assert (got[:8] == decode.MISSING).all()
    assert (
        got[8:].tobytes()
        == np.frombuffer(b"".join(truth(p, 0) for p in range(8, 11)), np.uint8)
        .astype(np.int16)
        .tobytes()
    )


def test_a_restore_longer_than_the_input_asks_rows_from_its_last_token() -> None:
    """Found by the simulator (seed 25645 with faults: a commit failing like a full disk, then
    routed experts): the sample's stored body is older than its snapshot, which a later segment
    replaced under the same key; restored, it made visible more tokens than the continuation
    sends, and rows were asked from past the input (`engine/base.py`): the sample recorded rows
    for positions its context does not have."""
    import asyncio
    from typing import Any

    from april_server.engine.base import SegmentCall
    from april_server.rules.placement import Slot
    from tests.unit.fake_engine import SnapshotFakeEngine

    class LongSnapshot(SnapshotFakeEngine):
        asked: list[int | None] = []

        async def restore_snapshot(self, key: str, slot: Slot, namespace: Any = None) -> int:
            return 37  # taken after more tokens than the body now holds

        async def generate_on(self, slot: Slot, call: SegmentCall) -> Any:
            self.asked.append(call.routing_start)
            return await super().generate_on(slot, call)

    eng = LongSnapshot(delay_s=0.0)
    ids = list(range(3, 25))  # 22 tokens: its last one, position 21, is always fed
    call = SegmentCall("g/0@c.1.x", "g/0", ids, {"max_new_tokens": 2}, Slot(), True, None, None, 0)
    asyncio.run(eng.run_segment(call))
    assert eng.asked == [21]  # before the fix: 37, past the input
