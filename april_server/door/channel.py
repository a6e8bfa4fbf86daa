"""The scheduler channel: what the HTTP process asks of SGLang's scheduler, one msgspec struct
per operation.

An operation travels msgpack-encoded as the `body` of the one request type SGLang's dispatcher
routes to us (`ipc.AprilKvReq`). The scheduler decodes it against the union of all operations,
so the tag (`op`) picks the struct and every field is checked against its type there, then
hands it to the handler its table names for that struct. A body that is not an operation (an
unknown tag, a missing or mistyped field, bytes that are not msgpack) and a handler that raises
come back as an error reply: the scheduler's loop never sees the exception.

No SGLang here: both processes and the unit tests import this module as it is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, get_args

import msgspec

logger = logging.getLogger(__name__)

Reply = tuple[bool, dict[str, Any]]  # (ok, payload); a failed one's payload says why


class SchedulerOp(msgspec.Struct, kw_only=True, tag_field="op"):
    """One operation; its tag (the `op` field on the wire) is the lowercase verb."""


class Mark(SchedulerOp, tag="mark"):
    """Snapshot request `rid`'s KV under `key` when it ends by abort (the abort follows on the
    same socket, so the mark is always there first)."""

    rid: str
    key: str


class Restore(SchedulerOp, tag="restore"):
    """Put snapshot `key` into the prefix cache and hold it there until `Unlock`."""

    key: str
    namespace: str = ""  # SGLang's `extra_key` the prefix goes under; "" = the shared cache


class Unlock(SchedulerOp, tag="unlock"):
    """Let go of the prefix a `Restore` of `key` holds."""

    key: str


class Drop(SchedulerOp, tag="drop"):
    """Forget snapshot `key` (and let go of its restored prefix)."""

    key: str


class Info(SchedulerOp, tag="info"):
    """Snapshot `key`'s size (tokens, bytes, routing bytes); fails if there is none."""

    key: str


class Keys(SchedulerOp, tag="keys"):
    """Every snapshot this rank holds, with its age in seconds."""


class Stats(SchedulerOp, tag="stats"):
    """The host store's and the KV pool's figures, and the admission bound."""


class Curve(SchedulerOp, tag="curve"):
    """Measured decode step times by batch size (the in-flight policy's curve)."""


class Clock(SchedulerOp, tag="clock"):
    """Seconds spent per forward kind."""


AnyOp = Mark | Restore | Unlock | Drop | Info | Keys | Stats | Curve | Clock
OPS: tuple[type[SchedulerOp], ...] = get_args(AnyOp)

# Each handler takes its own struct; the table's lookup by `type(op)` is what pairs them.
Handlers = Mapping[type[SchedulerOp], Callable[[Any], Reply]]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyOp)


def encode(op: SchedulerOp) -> bytes:
    return _encoder.encode(op)


def decode(body: bytes) -> SchedulerOp:
    """The operation `body` holds; raises msgspec.DecodeError (ValidationError included) if it
    holds none."""
    op: SchedulerOp = _decoder.decode(body)
    return op


def op_name(op: SchedulerOp) -> str:
    return str(type(op).__struct_config__.tag)


def answer(handlers: Handlers, body: bytes) -> Reply:
    """Decode `body` and run its handler; whatever goes wrong becomes a failed reply."""
    try:
        op = decode(body)
    except msgspec.DecodeError as exc:
        logger.error("april: not a scheduler operation: %s", exc)
        return False, {"error": f"not a scheduler operation: {exc}"}
    handler = handlers.get(type(op))
    if handler is None:
        logger.error("april: no handler for scheduler operation %r", op_name(op))
        return False, {"error": f"the scheduler has no handler for {op_name(op)!r}"}
    try:
        return handler(op)
    except Exception as exc:
        logger.exception("april: kv op %s failed", op_name(op))
        return False, {"error": str(exc)}
