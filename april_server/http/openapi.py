"""The routes' paths and types, and the OpenAPI document that shows them.

The routes (`app.py`) decode bodies with msgspec, so FastAPI cannot see their types itself:
`extend_openapi` puts the msgspec schemas of `ROUTE_TYPES` into the app's /openapi.json (for
clients and fuzzers).
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI

from april_client.protocol import (
    AbortReq,
    AbortResp,
    DeleteResp,
    ErrorResp,
    Group,
    GroupsReq,
    GroupsResp,
    InputReq,
    InputResp,
    LengthsForgotten,
    PartialsResp,
    RejectReq,
    ResumeReq,
    ResumeResp,
    RolloutReq,
    RolloutResp,
    WeightGroupInfo,
)

PREFIX = "/april/v1"  # every route of the contract lives under it

# Request and response types of each route, exported into /openapi.json (for clients and
# fuzzers): the routes decode bodies with msgspec, so FastAPI cannot see these types itself.
ROUTE_TYPES: dict[tuple[str, str], tuple[type | None, type]] = {
    ("post", PREFIX + "/rollouts"): (RolloutReq, RolloutResp),
    ("post", PREFIX + "/rollouts/{batch_id}/reject"): (RejectReq, dict),
    ("post", PREFIX + "/groups"): (GroupsReq, GroupsResp),
    ("post", PREFIX + "/abort"): (AbortReq, AbortResp),
    ("post", PREFIX + "/resume"): (ResumeReq, ResumeResp),
    ("post", PREFIX + "/samples/{sample_id}/input"): (InputReq, InputResp),
    ("post", PREFIX + "/samples/{sample_id:path}/input"): (InputReq, InputResp),
    ("get", PREFIX + "/partials"): (None, PartialsResp),
    ("get", PREFIX + "/partials/{group_id}"): (None, Group),
    ("delete", PREFIX + "/partials/{group_id}"): (None, DeleteResp),
    ("get", PREFIX + "/partials/{group_id:path}"): (None, Group),
    ("delete", PREFIX + "/partials/{group_id:path}"): (None, DeleteResp),
    ("get", PREFIX + "/stats"): (None, dict),
    ("get", PREFIX + "/weights/group"): (None, WeightGroupInfo),
    ("delete", PREFIX + "/lengths"): (None, LengthsForgotten),
}


def extend_openapi(app: FastAPI) -> None:
    """Put our msgspec schemas into the app's OpenAPI document (once, lazily)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema and app.openapi_schema.get("x-april"):
            return app.openapi_schema
        doc = original()
        types = [t for pair in ROUTE_TYPES.values() for t in pair if t not in (None, dict)]
        types.append(ErrorResp)
        schemas, components = msgspec.json.schema_components(
            types, ref_template="#/components/schemas/{name}"
        )
        doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
        by_type = dict(zip(types, schemas, strict=True))
        error = {"content": {"application/json": {"schema": by_type[ErrorResp]}}}
        for (method, path), (req_t, resp_t) in ROUTE_TYPES.items():
            op = doc.get("paths", {}).get(path, {}).get(method)
            if op is None:
                continue
            if req_t is not None:
                op["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": by_type[req_t]}},
                }
            ok_schema = by_type.get(resp_t, {"type": "object"})
            op["responses"] = {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": ok_schema}},
                },
                **{
                    code: {"description": "error", **error}
                    for code in ("400", "401", "403", "404", "409", "413", "422")
                },
            }
        doc["x-april"] = True
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
