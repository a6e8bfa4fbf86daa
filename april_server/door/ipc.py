"""Control messages between the HTTP process and the scheduler for KV snapshots.

They subclass SGLang's `BaseReq`, so they travel over SGLang's own ZMQ sockets (pickle IPC,
the default) and through its TypeBasedDispatcher on both sides; their classes live in an
importable module because the scheduler unpickles them by qualified name.
"""

from __future__ import annotations

from sglang.srt.managers.io_struct import BaseReq


class AprilKvReq(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    """`op`: mark (snapshot `key` when request `target` ends by abort) | restore | unlock |
    drop | info | stats. `call_id` pairs the answer with its caller."""

    call_id: int
    op: str
    key: str = ""
    target: str = ""


class AprilKvResp(BaseReq, kw_only=True):  # type: ignore[misc,call-arg]
    call_id: int
    ok: bool
    payload: str = "{}"  # JSON
