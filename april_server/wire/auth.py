"""Who may call what on /april/v1 (on top of SGLang's own `--api-key` middleware).

SGLang's middleware already requires `--api-key` (Bearer) on every route, ours included, when
it is set. We add an admin scope: when `--admin-api-key` is set, operations that affect other
callers' work (abort with `all`, deleting buffered groups) require it. Keys are compared in
constant time.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from april_server.wire.errors import ApiError


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    api_key: str | None = None
    admin_api_key: str | None = None

    def _bearer_is(self, header: str | None, key: str) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token, key)

    def require_user(self, header: str | None) -> None:
        keys = [k for k in (self.api_key, self.admin_api_key) if k]
        if self.api_key and not any(self._bearer_is(header, k) for k in keys):
            raise ApiError(401, "unauthorized", "send Authorization: Bearer <api key>")

    def require_admin(self, header: str | None, what: str) -> None:
        if self.admin_api_key:
            if not self._bearer_is(header, self.admin_api_key):
                raise ApiError(403, "forbidden", f"{what} needs the admin API key")
        else:
            self.require_user(header)
