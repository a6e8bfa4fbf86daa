"""`april_client`: the typed HTTP client of april-server (`client.py`).

Importing this package needs only httpx and msgspec: `AprilClient`/`AsyncAprilClient` cover
every `/april/v1` route and the SGLang routes a trainer needs; their wire types are in
`april_client.protocol`, which imports only msgspec. Its imports are relative, so a copy of
this folder under any other package name (a vendored client) works as it is.
"""

from ._errors import (
    AprilError,
    Conflict,
    InvalidRequest,
    NotFound,
    ProtocolError,
    RequestRejected,
    ServerError,
    TransportError,
    Unauthorized,
)
from ._stream import AsyncRolloutStream, RolloutStream
from .client import AprilClient, AsyncAprilClient

__all__ = [
    "AprilClient",
    "AprilError",
    "AsyncAprilClient",
    "AsyncRolloutStream",
    "Conflict",
    "InvalidRequest",
    "NotFound",
    "ProtocolError",
    "RequestRejected",
    "RolloutStream",
    "ServerError",
    "TransportError",
    "Unauthorized",
]
