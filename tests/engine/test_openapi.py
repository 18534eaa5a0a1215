"""docs/openapi.json is generated from the admin API's FastAPI app, and it describes what a live engine really
answers."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the engine extra

from bsr_cli.server.app import create_app, routes_of
from bsr_cli.server.openapi import render

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"


def test_the_document_is_the_generated_one() -> None:
    assert SPEC.read_text() == render(), "regenerate: python -m bsr_cli.server.openapi > docs/openapi.json"


def test_openapi_matches_the_served_routes() -> None:
    spec = json.loads(SPEC.read_text())
    routes = routes_of(create_app(None))
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert documented == {(r.method, r.path) for r in routes}
    assert len(documented) == 23  # 22 under /bsr/v1, and /metrics
    for r in routes:
        op = spec["paths"][r.path][r.method.lower()]
        assert ("security" in op) == r.auth, f"{r.method} {r.path}: auth documented wrongly"
        assert ("401" in op["responses"]) == r.auth
        assert "422" not in op["responses"], "malformed requests are answered 400, not FastAPI's 422"
        ok = op["responses"].get("201" if r.path.endswith("/faults") and r.method == "POST" else "200")
        media = ok["content"]
        if r.path != "/metrics":
            schema = media["application/json"]["schema"]
            assert schema.get("$ref"), f"{r.method} {r.path}: the answer is not typed"


@pytest.mark.engine
@pytest.mark.timeout(180)
def test_every_operation_answers_as_documented(engine) -> None:
    """One real call per operation and outcome against the session's engine: the status must be documented for that
    operation, the media type must be the documented one, and a JSON body must match the documented schema."""
    schemathesis = pytest.importorskip("schemathesis")
    schema = schemathesis.openapi.from_path(str(SPEC))
    spec = json.loads(SPEC.read_text())
    auth = {"Authorization": f"Bearer {engine.token}"}
    seen: set[tuple[str, str]] = set()

    def check(
        method: str, template: str, url_path: str, *, want: int, answered: httpx.Response | None = None, **kw
    ) -> httpx.Response:
        """``answered``: an answer already received (one that needs the engine in a state of its own)."""
        kw.setdefault("headers", auth)  # every route but /health needs the token (checked without it below)
        r = answered or httpx.request(method, engine.url + url_path, timeout=60, **kw)
        assert r.status_code == want, (method, url_path, r.status_code, r.text[:300])
        responses = spec["paths"][template][method.lower()]["responses"]
        assert str(r.status_code) in responses, f"{method} {template}: {r.status_code} is not documented"
        media = r.headers["content-type"].split(";")[0]
        assert media in responses[str(r.status_code)]["content"], f"{method} {template}: {media} not documented"
        if media == "application/json":
            schema[template][method].validate_response(r)
        seen.add((method, template))
        return r

    v1 = "/bsr/v1"
    check("GET", v1 + "/health", v1 + "/health", want=200, headers={})
    unhealthy = _frozen_rank_health(engine)  # the 503 a rank that stops answering makes /health answer
    check("GET", v1 + "/health", v1 + "/health", want=503, answered=unhealthy)
    assert unhealthy.json()["ok"] is False and unhealthy.json()["unhealthy_ranks"] == [1]
    check("GET", v1 + "/info", v1 + "/info", want=200)
    check("GET", v1 + "/registration", v1 + "/registration", want=200)
    own = check("GET", v1 + "/openapi.json", v1 + "/openapi.json", want=200).json()
    assert own["components"]["schemas"]["Synthetic"]["properties"]["n"]["maximum"] == engine.client().info().max_tokens
    body = {"synthetic": {"n": 700, "seed": 4242}}
    check("POST", v1 + "/requests", v1 + "/requests", want=200, json=body, headers=auth)
    streamed = check("POST", v1 + "/requests", v1 + "/requests", want=200, json=body | {"stream": True}, headers=auth)
    assert json.loads(streamed.text.splitlines()[-1])["type"] == "result"
    probe = check("POST", v1 + "/probe", v1 + "/probe", want=200, json=body | {"exclude_tiers": ["fs"]})
    assert probe.json()["committable_tokens"] == 700
    check("POST", v1 + "/probe", v1 + "/probe", want=400, json={"tokens": "nope"})
    ndjson = check("POST", v1 + "/restore", v1 + "/restore", want=200, json=body, headers=auth)
    assert json.loads(ndjson.text.splitlines()[-1])["result"]["outcome"] == "committed"
    plain = check("POST", v1 + "/restore", v1 + "/restore", want=200, json=body | {"stream": False}, headers=auth)
    assert plain.json()["committed_tokens"] == 700
    check("POST", v1 + "/restore", v1 + "/restore", want=401, json=body, headers={})
    check("GET", v1 + "/snapshot", v1 + "/snapshot", want=401, headers={"Authorization": "Bearer wrong"})
    check("POST", v1 + "/restores/{id}/abort", v1 + "/restores/req-nope/abort", want=404, headers=auth)
    check("GET", v1 + "/pool", v1 + "/pool?health=1", want=200)
    check("POST", v1 + "/pool/reset-peak", v1 + "/pool/reset-peak", want=200, headers=auth)
    check("POST", v1 + "/settings", v1 + "/settings", want=400, json={}, headers=auth)
    info = check("GET", v1 + "/info", v1 + "/info", want=200).json()
    check("POST", v1 + "/settings", v1 + "/settings", want=200, json={"W": info["W"]}, headers=auth)
    check("POST", v1 + "/settings", v1 + "/settings", want=400, json={"budget_bytes": 1}, headers=auth)
    check("GET", v1 + "/snapshot", v1 + "/snapshot?health=0&events_since=0", want=200)
    check("GET", v1 + "/events", v1 + "/events?since=0&wait=0", want=200)
    fault = check("POST", v1 + "/faults", v1 + "/faults", want=201, json={"kind": "timeout"}, headers=auth)
    assert fault.json()["kind"] == "timeout"
    check("GET", v1 + "/faults", v1 + "/faults", want=200)
    check("DELETE", v1 + "/faults", v1 + "/faults", want=200, headers=auth)
    scrubbed = check("POST", v1 + "/scrub", v1 + "/scrub", want=200, json=body | {"tier": "fs"}, headers=auth)
    assert scrubbed.json()["complete"] and scrubbed.json()["damaged"] == 0
    check("POST", v1 + "/scrub", v1 + "/scrub", want=400, json={"tier": "fs"}, headers=auth)
    check("GET", v1 + "/markers", v1 + "/markers", want=200)
    check("DELETE", v1 + "/markers", v1 + "/markers", want=200, headers=auth)
    cleared = check("DELETE", v1 + "/markers/prompts/{prompt}", v1 + "/markers/prompts/p-none", want=200)
    assert cleared.json() == {"cleared": 0}
    check("DELETE", v1 + "/markers/tiers/{tier}", v1 + "/markers/tiers/mooncake", want=200)
    check("DELETE", v1 + "/markers/tiers/{tier}", v1 + "/markers/tiers/ssd", want=400)
    check(
        "POST", v1 + "/shutdown", v1 + "/shutdown", want=401, headers={}
    )  # the authorised call is in the fuzz test's engine
    check("GET", "/metrics", "/metrics", want=200)
    assert seen == {(m, p) for p, ops in spec["paths"].items() for m in (o.upper() for o in ops)}


def _frozen_rank_health(engine) -> httpx.Response:
    """GET /health while rank 1 is frozen (SIGSTOP) past the stall time, then resumed: the engine is healthy again
    before this returns."""
    from bsr_cli.engine import supervisor

    pid = next(p.pid for p in supervisor.status(engine.state_dir).processes if p.name == "rank1")
    health = engine.url + "/bsr/v1/health"
    pause = threading.Event()
    os.kill(pid, signal.SIGSTOP)
    try:
        for _ in range(600):  # the stall time is the fetch timeout (2 s): bounded at 60 s
            r = httpx.get(health, timeout=30)
            if r.status_code != 200:
                break
            pause.wait(0.1)
    finally:
        os.kill(pid, signal.SIGCONT)
    for _ in range(600):
        if httpx.get(health, timeout=30).status_code == 200:
            break
        pause.wait(0.1)
    assert httpx.get(health, timeout=30).status_code == 200, "the engine did not turn healthy after the resume"
    return r
