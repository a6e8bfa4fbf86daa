"""Clients of april-server: the typed HTTP client (`client.py`) and `april-bench` (`bench/`).

Importing this package needs only httpx and msgspec: `AprilClient`/`AsyncAprilClient` cover
every `/april/v1` route and the SGLang routes a trainer needs; their wire types are in
`april_server.protocol`, which imports only msgspec.
"""

from clients._errors import (
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
from clients._stream import AsyncRolloutStream, RolloutStream
from clients.client import AprilClient, AsyncAprilClient

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
