"""`april_client`: the typed HTTP client of april-server (`client.py`) and `april-bench` (`bench/`).

Importing this package needs only httpx and msgspec: `AprilClient`/`AsyncAprilClient` cover
every `/april/v1` route and the SGLang routes a trainer needs; their wire types are in
`april_server.protocol`, which imports only msgspec. The sources live in the `clients/` folder;
the package is `april_client` (`from april_client import AprilClient`). The old `clients` name
still works from a checkout, deprecated (`_legacy.py`).
"""

if __name__ == "clients":  # the deprecated name, imported from a checkout
    from ._legacy import alias

    alias(__name__)
else:
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
