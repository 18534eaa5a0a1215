"""docs/openapi.json describes exactly the routes the admin server serves."""

from __future__ import annotations

import json
from pathlib import Path

from bsr_cli.runtime.admin import ROUTES

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_openapi_matches_the_routing_table() -> None:
    spec = json.loads(SPEC.read_text())
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    served = {(m, "/bsr/v1" + p) for m, p in ROUTES} | {("GET", "/metrics")}
    assert documented == served
    for (method, path), (_, auth) in ROUTES.items():
        op = spec["paths"]["/bsr/v1" + path][method.lower()]
        assert ("security" in op) == auth, f"{method} {path}: auth documented wrongly"
