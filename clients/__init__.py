"""Clients of april-server; importable with only httpx and msgspec installed.

`AprilClient`/`AsyncAprilClient` cover every `/april/v1` route and the SGLang routes a trainer
needs; the wire types are re-exported from `april_server.protocol` (which imports only msgspec).
"""

from april_server.protocol import (
    AbortResp,
    DeleteResp,
    DoneEvent,
    Group,
    GroupFinishedEvent,
    GroupSpec,
    ResumeResp,
    RolloutResp,
    RolloutStats,
    Sample,
    Segment,
)
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
from clients.client import (
    DEFAULT_TIMEOUT,
    AprilClient,
    AsyncAprilClient,
    AsyncRolloutStream,
    RolloutStream,
)

__all__ = [
    "AbortResp",
    "AprilClient",
    "AprilError",
    "AsyncAprilClient",
    "AsyncRolloutStream",
    "Conflict",
    "DEFAULT_TIMEOUT",
    "DeleteResp",
    "DoneEvent",
    "Group",
    "GroupFinishedEvent",
    "GroupSpec",
    "InvalidRequest",
    "NotFound",
    "ProtocolError",
    "RequestRejected",
    "ResumeResp",
    "RolloutResp",
    "RolloutStats",
    "RolloutStream",
    "Sample",
    "Segment",
    "ServerError",
    "TransportError",
    "Unauthorized",
]
