"""Environment variables april-server reads, declared once (the CLI sets them for SGLang's
spawned scheduler, which cannot see our parsed flags)."""

from __future__ import annotations

import os

KV_HOST_BYTES = "APRIL_KV_HOST_BYTES"  # host byte budget of the KV snapshot store
DEFAULT_KV_HOST_BYTES = 2 * 1024**3


def kv_host_bytes() -> int:
    raw = os.environ.get(KV_HOST_BYTES, "")
    return int(raw) if raw else DEFAULT_KV_HOST_BYTES


def set_kv_host_bytes(value: int) -> None:
    os.environ[KV_HOST_BYTES] = str(value)
