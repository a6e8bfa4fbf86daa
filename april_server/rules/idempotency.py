"""`request_id` on `/rollouts`: a retry gets the answer of the attempt that delivered one.
An attempt that delivered none (its caller went away, or it failed) leaves a record of the
groups it handed in, durably with the buffer, so a retry runs again on them."""

from __future__ import annotations

import msgspec

from april_client.protocol import RolloutReq

_ATTEMPT = b"attempt:"  # a `calls` row that holds no response, only what an attempt handed in
_ids_enc = msgspec.json.Encoder()
_ids_dec = msgspec.json.Decoder(list[str])


def attempt_record(req: RolloutReq) -> bytes:
    return _ATTEMPT + _ids_enc.encode([g.group_id for g in req.groups])


def is_attempt(stored: bytes) -> bool:
    return stored.startswith(_ATTEMPT)


def handed_in_by(stored: bytes) -> frozenset[str]:
    return frozenset(_ids_dec.decode(stored[len(_ATTEMPT) :]))
