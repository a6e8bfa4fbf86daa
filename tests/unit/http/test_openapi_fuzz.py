"""Schemathesis over the exported /openapi.json of the april routes (fake engine, in process):
no server error, and every rejection carries the contract's error body."""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings

from april_server.http.app import extend_app
from tests.unit.http.test_app import app_and_manager

app, manager = app_and_manager(delay_s=0.0)
extend_app(app)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_april_routes_never_5xx(case: schemathesis.Case) -> None:
    response = case.call()
    assert response.status_code < 500, (case.path, case.body, response.text)
    if response.status_code >= 400:
        assert "error" in response.json(), (
            case.method,
            case.path,
            case.path_parameters,
            case.body,
            response.status_code,
            response.text,
        )
        err = response.json()["error"]
        assert isinstance(err["code"], str) and err["code"]
        assert isinstance(err["message"], str) and err["message"]
    manager.check_integrity()
