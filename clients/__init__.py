"""Clients of april-server: the typed HTTP client (`client.py`) and `april-bench` (`bench/`).

Importing this package needs only httpx and msgspec.
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
from clients.client import AprilClient, AsyncAprilClient

__all__ = [
    "AprilClient",
    "AprilError",
    "AsyncAprilClient",
    "Conflict",
    "InvalidRequest",
    "NotFound",
    "ProtocolError",
    "RequestRejected",
    "ServerError",
    "TransportError",
    "Unauthorized",
]
