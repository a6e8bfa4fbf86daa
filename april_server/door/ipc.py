"""The envelopes of the scheduler channel (`channel.py`) on SGLang's sockets.

They subclass SGLang's `BaseReq`, so they travel over SGLang's own ZMQ sockets (pickle IPC,
the default) and through its TypeBasedDispatcher on both sides; their classes live in an
importable module because the scheduler unpickles them by qualified name. The operation
itself rides as msgpack bytes: whatever is in them, the envelope always unpickles, and the
scheduler answers a body it cannot read with an error reply.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq


class AprilKvReq(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    """`body`: one `channel.SchedulerOp`, as `channel.encode` writes it. `call_id` pairs the
    answers with their caller.

    With data parallelism SGLang's DP controller broadcasts every message that is not a
    generate request to all ranks: `dp_rank` says which one acts and answers (-1: all of
    them, each with its own figures)."""

    call_id: int
    body: bytes
    dp_rank: int = -1


class AprilKvResp(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    call_id: int
    ok: bool
    payload: str = "{}"  # JSON
    dp_rank: int = 0  # the rank that answers (replies share the tokenizer's socket)
