"""Where the owner finds its engine servers: a static list (`--april-engines`), or
sgl-model-gateway's worker registry (`--april-smg`), read on every health round (`smg.py`).

smg is the registry only: who the engines are. The owner health-checks them itself (a
segment needs the engine that holds its snapshot, which smg's routing cannot name), so an
engine smg still lists but the owner cannot reach is out of the pool, and one that leaves
smg's list leaves the pool."""

from __future__ import annotations

import httpx

from april_server.fleet.fleet import Discover
from april_server.fleet.smg import smg_workers

SMG_TIMEOUT_S = 5.0


def smg_discovery(gateway_url: str, api_key: str | None = None) -> Discover:
    """A `Discover` reading smg's `GET /workers` (`api_key`: smg's own `--api-key`)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = httpx.AsyncClient(headers=headers, timeout=SMG_TIMEOUT_S)

    async def discover() -> list[str]:
        return [w.url for w in await smg_workers(http, gateway_url)]

    return discover
