"""`april_client`: the typed HTTP client of april-server (`client.py`).

Importing this package needs only httpx and msgspec: `AprilClient`/`AsyncAprilClient` cover
every `/april/v1` route and the SGLang routes a trainer needs; their wire types are in
`april_client.protocol`, which imports only msgspec. The sources live in the `clients/` folder;
the package is `april_client` (`from april_client import AprilClient`). The folder's own name is
not an import name: from a checkout, `import clients` fails with a pointer to `april_client`
(a second copy under another name would make every class exist twice). A vendored copy under
any other package name works.
"""

if __name__ == "clients":
    raise ImportError("`clients` is not a package name: import `april_client` instead")
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
