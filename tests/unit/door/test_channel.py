"""The scheduler channel (door/channel.py): every operation survives the wire as its own struct,
the scheduler's handler table answers every one of them, and a body that holds no operation, or
a handler that raises, comes back as an error reply. In process, without SGLang (the envelope
SGLang dispatches is checked in scheduler_kv_check.py)."""

from __future__ import annotations

import typing
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from april_server.door import channel
from april_server.door.channel import (
    OPS,
    Clock,
    Curve,
    Drop,
    Info,
    Keys,
    Mark,
    Restore,
    SchedulerOp,
    Stats,
    Unlock,
    answer,
    decode,
    encode,
)
from april_server.door.scheduler_hooks import SchedulerKv

EXAMPLES: list[SchedulerOp] = [
    Mark(rid="rid-1", key="g/0/s/1"),
    Restore(key="g/0/s/1"),
    Restore(key="g/0/s/1", namespace="april-stale/g/0/s/1"),
    Unlock(key="g/0/s/1"),
    Drop(key="g/0/s/1"),
    Info(key="g/0/s/1"),
    Keys(),
    Stats(),
    Curve(),
    Clock(),
]


def test_the_examples_cover_every_operation() -> None:
    assert {type(op) for op in EXAMPLES} == set(OPS)
    assert len({op_type.__struct_config__.tag for op_type in OPS}) == len(OPS)


@pytest.mark.parametrize("op", EXAMPLES, ids=repr)
def test_every_operation_decodes_as_itself(op: SchedulerOp) -> None:
    back = decode(encode(op))
    assert type(back) is type(op) and back == op


@pytest.mark.parametrize("op", EXAMPLES, ids=repr)
def test_the_wire_names_the_operation_in_its_op_field(op: SchedulerOp) -> None:
    wire = msgspec.msgpack.decode(encode(op))
    assert wire["op"] == channel.op_name(op) == type(op).__struct_config__.tag
    assert set(wire) == {"op", *type(op).__struct_fields__}


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (msgspec.msgpack.encode({"op": "defragment"}), "Invalid value 'defragment'"),
        (msgspec.msgpack.encode({"key": "k"}), "missing required field `op`"),
        (msgspec.msgpack.encode({"op": "mark", "key": "k"}), "missing required field `rid`"),
        (msgspec.msgpack.encode({"op": "drop", "key": 3}), "Expected `str`, got `int`"),
        (msgspec.msgpack.encode(["drop", "k"]), "Expected `object`, got `array`"),
        (b"\xc1", "malformed"),
        (b"", "truncated"),
    ],
    ids=["unknown tag", "no tag", "missing field", "mistyped field", "array", "garbage", "empty"],
)
def test_a_body_that_holds_no_operation_is_an_error_reply(body: bytes, why: str) -> None:
    with pytest.raises(msgspec.DecodeError, match=why):
        decode(body)
    called: list[Any] = []
    ok, payload = answer({op_type: called.append for op_type in OPS}, body)
    assert not ok and called == []
    assert payload["error"].startswith("not a scheduler operation: ") and why in payload["error"]


def test_an_operation_without_a_handler_is_an_error_reply() -> None:
    ok, payload = answer({Keys: lambda op: (True, {})}, encode(Stats()))
    assert (ok, payload) == (False, {"error": "the scheduler has no handler for 'stats'"})


def test_a_handler_that_raises_is_an_error_reply() -> None:
    def broken(op: Info) -> channel.Reply:
        raise KeyError("half-written snapshot")

    ok, payload = answer({Info: broken}, encode(Info(key="k")))
    assert (ok, payload) == (False, {"error": "'half-written snapshot'"})


def test_the_handler_gets_the_decoded_struct_and_its_reply_goes_back() -> None:
    seen: list[SchedulerOp] = []

    def restore(op: Restore) -> channel.Reply:
        seen.append(op)
        return True, {"restored": 4}

    body = encode(Restore(key="k", namespace="ns"))
    assert answer({Restore: restore}, body) == (True, {"restored": 4})
    assert seen == [Restore(key="k", namespace="ns")]


# ---- the scheduler's table -----------------------------------------------------------------------


def _scheduler_kv(unlocked: list[Any] | None = None) -> SchedulerKv:
    """A SchedulerKv over fakes, enough for the handlers that touch no KV pool; the tree locks
    it lets go of go to `unlocked`."""
    kv = SchedulerKv.__new__(SchedulerKv)
    kv.marked, kv.locks, kv.tp = OrderedDict(), {}, 1
    unlocked = [] if unlocked is None else unlocked
    kv.sched = SimpleNamespace(tree_cache=SimpleNamespace(unlock=unlocked.append))
    snaps = {"g/0/s/1": {"tokens": 3, "bytes": 12}}
    kv.store = SimpleNamespace(
        info=snaps.get, drop=lambda key: snaps.pop(key, None) is not None, ages=lambda: {}
    )
    kv.handlers = kv.handler_table()
    return kv


def test_the_table_has_a_handler_for_every_operation_and_each_takes_its_own_struct() -> None:
    table = _scheduler_kv().handler_table()
    assert set(table) == set(OPS)
    for op_type, handler in table.items():
        assert typing.get_type_hints(handler)["op"] is op_type, handler


def test_the_scheduler_answers_through_its_table() -> None:
    unlocked: list[Any] = []
    kv = _scheduler_kv(unlocked)
    assert answer(kv.handlers, encode(Mark(rid="rid-1", key="g/0/s/1"))) == (True, {})
    assert kv.marked == {"rid-1": "g/0/s/1"}
    assert answer(kv.handlers, encode(Info(key="g/0/s/1"))) == (True, {"tokens": 3, "bytes": 12})
    kv.locks["g/0/s/1"] = "lock"
    assert answer(kv.handlers, encode(Drop(key="g/0/s/1"))) == (True, {})
    assert kv.locks == {} and unlocked == ["lock"]
    assert answer(kv.handlers, encode(Info(key="g/0/s/1"))) == (False, {})
    assert answer(kv.handlers, encode(Unlock(key="g/0/s/1"))) == (False, {})
    ok, payload = answer(kv.handlers, msgspec.msgpack.encode({"op": "compact", "key": "k"}))
    assert not ok and "Invalid value 'compact'" in payload["error"]
