"""Engine servers as listed by an sgl-model-gateway (`smg`) worker registry.

Reads the worker list of smg 1.13.0 (PyPI `smg`, the Rust gateway; `smg launch ...`) from
`GET {gateway}/workers`, and registers a worker with `POST {gateway}/workers`. Both routes are
served with or without `--enable-rl`; the module does not need the RL control plane.

What smg 1.13.0 answers (captured from the real binary on CPU; the unit tests replay it):

* `GET /workers` -> 200 `{"workers": [...], "total": N, "stats": {...}}`. Each worker carries
  `id` (a UUIDv7 string, assigned by smg), `url` (exactly as registered), `is_healthy` (bool)
  and `status` (`ready`, `not_ready`, `failed`, `draining`), plus `model_id`, `models`,
  `labels` (string map: smg's own discoveries and the caller's), `runtime_type`, `load`, ...
  A worker whose registration is still in progress (`status: pending`) is NOT in the list;
  `GET /workers/{id}` shows it, with a `job_status`.
* `POST /workers` with `{"url": ..., "labels": {...}}` (unknown keys ignored) -> 202
  `{"status": "accepted", "worker_id", "url", "location", "message"}`: registration is queued
  and runs in the background. A live SGLang worker is listed about 0.2 s later; a worker that
  does not answer yet stays `pending` and is retried every `--worker-startup-check-interval`
  (30 s apart by default; up to `--worker-startup-timeout-secs`, 1800 s per `--help`), then listed
  under the id the 202 gave. The same URL string again -> 409 `WORKER_ALREADY_EXISTS`
  (`WORKER_CREATE_IN_PROGRESS` while the first registration is still pending); URLs
  are compared as strings (`http://h:1` and `http://h:1/` become two workers), so
  `smg_register` strips a trailing `/`. A URL without `http://` (etc.) -> 400.
* `DELETE /workers/{id}` -> 202; the worker shows `draining` for 5 s, then leaves the list.
* Keys: `POST /workers {"api_key": K}` makes smg send `Authorization: Bearer K` to that worker
  (registration, health checks, RL passthrough; the first `/health` probes go without it, which
  SGLang allows: it exempts `/health*` and `/metrics` from `--api-key`). smg's own
  `--api-key K` makes its API (`/workers` included) answer 401 without `Bearer K`, and is
  not sent to workers registered through the API.

Registration requests to the worker (in order): `GET /health` (twice), `GET /v1/models`
(backend detection: `owned_by: sglang`), `GET /server_info`, `GET /model_info`,
`GET /v1/models`, `GET /health`; then its load monitor asks `GET /loads?model=...`,
`GET /v1/loads?include=...` and `GET /metrics`, and goes on with `GET /metrics` every 10 s
(the fake worker answered 404 to the first two). Health checks are `GET /health` every
`--health-check-interval-secs` (default 60 s, seen; `--health-check-endpoint` changes the path,
per `--help`); a refused connection and a 503 are failures.
With `--health-failure-threshold` F (default 3), F consecutive failures turn a worker
`not_ready` (`is_healthy: false`) and 4*F turn it `failed` (seen with F=3 and F=1). Measured
with F=3 and a 2 s interval: `not_ready` 5.1 s and `failed` 23 s after the worker was killed;
the worker stays listed and keeps being probed, and is `ready` again after
`--health-success-threshold` (default 2) good probes (3 s after it came back). With
`--remove-unhealthy-workers` a `failed` worker is removed instead (12 s after the kill at a
1 s interval) and is not re-added when it returns: register it again.

`--enable-rl` adds `/v1/rl/workers` (a different worker shape: `health` instead of
`is_healthy`/`status`, plus `engine`, `control_url`, `capabilities`, ...),
`/v1/rl/workers/{id}/engine/{path}` (forwards any method and path to the worker and wraps
the answer as `{"worker_id", "url", "status", "latency_ms", "body"}`) and
`/v1/rl/engine/{path}?selector=k=v` (fan-out to every worker whose labels match).
`parse_workers` reads that shape too (`health == "ready"` means healthy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

WORKERS_PATH = "/workers"
SMG_VERSION = "1.13.0"  # the version whose answers this module was checked against
# 409 codes of a `POST /workers` for a URL smg already has (listed, or still being registered).
_ALREADY_THERE = ("WORKER_ALREADY_EXISTS", "WORKER_CREATE_IN_PROGRESS")


class SmgError(RuntimeError):
    """smg answered with an error status or with a body this module does not understand."""


@dataclass(frozen=True)
class SmgWorker:
    """One worker in smg's registry."""

    url: str
    worker_id: str
    healthy: bool


async def smg_workers(http: httpx.AsyncClient, gateway_url: str) -> list[SmgWorker]:
    """The workers smg lists (`GET /workers`); registrations still pending are not among them.

    Raises `SmgError` on a non-2xx answer or an unexpected body; transport errors are
    httpx's own.
    """
    url = gateway_url.rstrip("/") + WORKERS_PATH
    resp = await http.get(url)
    if not resp.is_success:
        raise SmgError(f"GET {url}: HTTP {resp.status_code}: {resp.text[:500]}")
    try:
        payload = resp.json()
    except ValueError as e:
        raise SmgError(f"GET {url}: not JSON: {resp.text[:200]!r}") from e
    return parse_workers(payload, source=f"GET {url}")


def parse_workers(payload: Any, *, source: str = "smg worker list") -> list[SmgWorker]:
    """Parse `{"workers": [...]}` as `GET /workers` (or `GET /v1/rl/workers`) returns it."""
    if not isinstance(payload, dict) or not isinstance(payload.get("workers"), list):
        raise SmgError(
            f"{source}: expected a JSON object with a 'workers' list, got {_brief(payload)}"
        )
    return [_worker(item, source, i) for i, item in enumerate(payload["workers"])]


async def smg_register(
    http: httpx.AsyncClient,
    gateway_url: str,
    worker_url: str,
    *,
    labels: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> None:
    """Ask smg to register `worker_url` (`POST /workers`); already registered counts as done.

    "Already registered" is smg's 409 for the same URL, listed or still being registered; its
    labels and key are then left as they were (smg's `PUT`/`PATCH /workers/{id}` change them).

    smg registers in the background (it answers 202 at once): the worker shows up in
    `smg_workers` only once smg has reached it. `labels` are added to the worker's labels
    (they can select it for `/v1/rl/engine/{path}?selector=key=value`). `api_key` is the
    worker's own key (SGLang `--api-key`): smg sends it as a Bearer token to the worker. The
    gateway's key, if smg runs with `--api-key`, goes in `http`'s headers.
    """
    url = gateway_url.rstrip("/") + WORKERS_PATH
    body: dict[str, Any] = {"url": worker_url.rstrip("/")}
    if labels:
        body["labels"] = dict(labels)
    if api_key is not None:
        body["api_key"] = api_key
    resp = await http.post(url, json=body)
    if resp.is_success:
        return
    if resp.status_code == 409 and _error_code(resp) in _ALREADY_THERE:
        return
    raise SmgError(f"POST {url} {body['url']}: HTTP {resp.status_code}: {resp.text[:500]}")


def _worker(item: Any, source: str, index: int) -> SmgWorker:
    where = f"{source}: workers[{index}]"
    if not isinstance(item, dict):
        raise SmgError(f"{where}: expected an object, got {_brief(item)}")
    url, worker_id = item.get("url"), item.get("id")
    if not isinstance(url, str) or not url:
        raise SmgError(f"{where}: no 'url' string in {_brief(item)}")
    if not isinstance(worker_id, str) or not worker_id:
        raise SmgError(f"{where}: no 'id' string in {_brief(item)}")
    return SmgWorker(url=url, worker_id=worker_id, healthy=_healthy(item))


def _healthy(item: dict[str, Any]) -> bool:
    """`is_healthy` when present, else `status` / `health` == "ready", else not healthy."""
    flag = item.get("is_healthy")
    if isinstance(flag, bool):
        return flag
    for key in ("status", "health"):
        value = item.get(key)
        if isinstance(value, str):
            return value == "ready"
    return False


def _error_code(resp: httpx.Response) -> str | None:
    try:
        payload = resp.json()
    except ValueError:
        return None
    code = payload.get("code") if isinstance(payload, dict) else None
    return code if isinstance(code, str) else None


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
