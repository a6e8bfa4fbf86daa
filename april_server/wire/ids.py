"""Identifiers of the contract (`docs/api.md`, "Identifiers").

`group_id` and `request_id` are 1-128 characters from `[A-Za-z0-9._:-]`, so every id
round-trips through every route that names it (`/partials/{group_id}`, `sample_id =
"{group_id}/{index}"`). Checked at submission, before anything starts; ids already in a state
dir from before this rule still load and stay reachable (see `app.py`: the group route takes
a URL-encoded path).
"""

from __future__ import annotations

import re

from april_server.wire.errors import ApiError

MAX_ID_LEN = 128
_ID = re.compile(rf"[A-Za-z0-9._:-]{{1,{MAX_ID_LEN}}}")
# A member's index as the server writes it: ASCII digits, no leading zero ("g/01" and "g/²"
# name no sample; read as 1 and 2 they would alias "g/1", or crash `int`).
_SAMPLE_ID = re.compile(r"(.+)/(0|[1-9][0-9]{0,8})")


def split_sample_id(sample_id: str) -> tuple[str, int] | None:
    """(group id, member index) of a well-formed `sample_id`, else None."""
    m = _SAMPLE_ID.fullmatch(sample_id)
    return None if m is None else (m.group(1), int(m.group(2)))


def valid_id(value: str) -> bool:
    return _ID.fullmatch(value) is not None


def check_id(kind: str, value: str) -> None:
    """Raise 422 `invalid_id` unless `value` is a well-formed identifier."""
    if not valid_id(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ApiError(
            422,
            "invalid_id",
            f"{kind} {shown!r} is not an identifier: 1-{MAX_ID_LEN} characters from "
            "[A-Za-z0-9._:-] (no '/', whitespace or control characters)",
        )
