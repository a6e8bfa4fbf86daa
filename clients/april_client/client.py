"""Typed clients for april-server: `AprilClient` (sync) and `AsyncAprilClient` (asyncio).

Both speak the contract in `docs/api.md` (routes under `/april/v1`) plus the SGLang native
routes a trainer needs (`/generate`, `/update_weights_from_disk`, `/flush_cache`, `/health`,
`/metrics`). Each owns one httpx client; use it as a context manager or call `close()`.

    from april_client import AprilClient

    specs = [{"group_id": "q17", "input_ids": [1, 2, 3], "n": 8}]
    with AprilClient("http://127.0.0.1:30000", retries=2) as client:
        resp = client.rollout(specs, 1, request_id="step-17")  # idempotent: may be retried
        for event in client.rollout_stream(specs, 1):  # GroupFinishedEvent..., DoneEvent
            ...

Where each part lives (this module only gathers the two clients under their historic path):
`_routes.py` what a route sends and how its answer is read, shared by both clients;
`_base.py` the shared constructor, default timeout and argument types; `_sync.py` and
`_async.py` one line per route plus one generic send (with opt-in retries) each;
`_stream.py` the streamed-rollout reader and iterators; `_errors.py` the exceptions.
"""

from ._async import AsyncAprilClient
from ._base import DEFAULT_TIMEOUT, GroupArg
from ._sync import AprilClient

__all__ = ["DEFAULT_TIMEOUT", "AprilClient", "AsyncAprilClient", "GroupArg"]
