"""docs/openapi.json describes what the admin API really sends: every answer of the real HTTP server (over a
coordinator with fake ranks) is valid against the schema the document gives its route and status, including
the results and events a streamed answer carries, and the document is valid OpenAPI 3.1."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's
pytest.importorskip("jsonschema_rs")  # schemathesis's validator (the dev extra)
pytest.importorskip("schemathesis")

import jsonschema_rs
import schemathesis

from bsr_cli.server.admin import PREFIX, AdminServer
from bsr_cli.server.openapi import render
from unit.fixtures import FakeEngine, build_engine

SPEC = Path(__file__).resolve().parents[2] / "docs" / "openapi.json"
TOKEN = "documented-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = {"synthetic": {"n": 200, "seed": 7}}


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    return json.loads(SPEC.read_text())


@pytest.fixture
def served() -> Iterator[tuple[FakeEngine, AdminServer]]:
    eng = build_engine(fetch_timeout_s=20.0)
    server = AdminServer(eng.coordinator, token=TOKEN)
    server.start()
    try:
        yield eng, server
    finally:
        server.stop()
        for r in eng.ranks:
            r.close()


def _validator(doc: dict[str, Any], template: str, method: str, status: int) -> Any:
    """The validator of what ``method template`` answers with ``status`` as JSON, by the document."""
    responses = doc["paths"][template][method.lower()]["responses"]
    assert str(status) in responses, f"{method} {template}: {status} is not documented"
    schema = responses[str(status)]["content"]["application/json"]["schema"]
    return jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]})


class Caller:
    """Calls the served API and checks each JSON answer (and each line of an NDJSON one) against the document."""

    def __init__(self, server: AdminServer, doc: dict[str, Any]) -> None:
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.doc = doc
        self.operations = schemathesis.openapi.from_path(str(SPEC))  # the engine test's validator too
        self.checked: set[tuple[str, str, int]] = set()

    def __call__(
        self, method: str, template: str, path: str | None = None, *, want: int, token: bool = True, **kw: Any
    ) -> Any:
        r = self.http.request(method, path or template, headers=AUTH if token else {}, **kw)
        assert r.status_code == want, (method, path or template, r.status_code, r.text[:300])
        validator = _validator(self.doc, template, method, want)
        media = r.headers["content-type"].split(";")[0]
        if media == "application/x-ndjson":
            lines = [json.loads(line) for line in r.text.splitlines()]
            result = next(line["result"] for line in lines if line["type"] == "result")
            validator.validate(result)
            any_event = self.doc["components"]["schemas"]["EventPage"]["properties"]["events"]["items"]
            event = jsonschema_rs.Draft202012Validator({**any_event, "components": self.doc["components"]})
            for line in lines:
                if line["type"] == "event":
                    event.validate(line["event"])
            answer: Any = lines
        else:
            assert media == "application/json", (method, path, media)
            answer = r.json()
            validator.validate(answer)
            self.operations[template][method].validate_response(r)
        self.checked.add((method, template, want))
        return answer


def test_the_document_is_the_generated_one_and_valid_openapi_3_1(doc: dict[str, Any]) -> None:
    from schemathesis.specs.openapi.definitions import OPENAPI_31

    assert SPEC.read_text() == render(), "regenerate: python -m bsr_cli.server.openapi > docs/openapi.json"
    assert doc["openapi"].startswith("3.1")
    errors = [str(e)[:300] for e in jsonschema_rs.validator_for(OPENAPI_31).iter_errors(doc)]
    assert errors == []
    invalid = [name for name, schema in doc["components"]["schemas"].items() if not jsonschema_rs.meta.is_valid(schema)]
    assert invalid == []


@pytest.mark.timeout(120)
def test_every_answer_is_valid_against_the_document(served: tuple[FakeEngine, AdminServer], doc: dict) -> None:
    eng, server = served
    call = Caller(server, doc)
    try:
        _call_every_route(eng, call, doc)
    finally:
        call.http.close()


def _call_every_route(eng: FakeEngine, call: Caller, doc: dict[str, Any]) -> None:
    v1 = PREFIX
    call("GET", v1 + "/health", want=200, token=False)
    call("GET", v1 + "/info", want=200)
    call("GET", v1 + "/registration", want=200)
    call("GET", v1 + "/openapi.json", want=200)
    submitted = call("POST", v1 + "/requests", want=200, json=PROMPT)
    assert submitted["source"] == "recompute" and submitted["stored"]  # computed, then stored
    call("POST", v1 + "/requests", want=200, json=PROMPT | {"stream": True})
    probe = call("POST", v1 + "/probe", want=200, json=PROMPT)
    assert probe["committable_tokens"] == 200 and probe["first_break"] is None
    restored = call("POST", v1 + "/restore", want=200, json=PROMPT | {"stream": False})
    assert restored["outcome"] == "committed" and restored["committed_tokens"] == 200
    call("POST", v1 + "/restore", want=200, json=PROMPT)  # NDJSON: its result and its events
    # A restore that fails closed: its failures, the marker it sets, its events and its entry among the recent.
    fault = call("POST", v1 + "/faults", want=201, json={"kind": "timeout", "rank": 1, "window": 0})
    assert fault["kind"] == "timeout" and fault["rank"] == 1
    call("GET", v1 + "/faults", want=200)
    failed = call("POST", v1 + "/restore", want=200, json=PROMPT | {"stream": False})
    assert failed["outcome"] == "failed_closed" and failed["failures"] and failed["marker"]
    listed = call("GET", v1 + "/markers", want=200)
    assert [m["excluded_tiers"] for m in listed["markers"]] == [["mooncake"]]
    resubmitted = call("POST", v1 + "/requests", want=200, json=PROMPT)  # the marker makes it skip mooncake
    assert resubmitted["passes"][0]["excluded_tiers"] == ["mooncake"]
    call("GET", v1 + "/pool", v1 + "/pool?health=1", want=200)
    call("GET", v1 + "/pool", want=200)
    call("POST", v1 + "/pool/reset-peak", want=200)
    info = call("POST", v1 + "/settings", want=200, json={"W": 2})
    assert info["W"] == 2
    snap = call("GET", v1 + "/snapshot", v1 + "/snapshot?events_since=0", want=200)
    assert {e["type"] for e in snap["events"]} >= {"restore_failed", "restore_failed_closed", "marker_set"}
    assert {r["outcome"] for r in snap["recent"]} >= {"committed", "failed_closed"}
    page = call("GET", v1 + "/events", v1 + "/events?since=0", want=200)
    assert page["events"] and page["held"] == len(page["events"])
    call("DELETE", v1 + "/faults", want=200)
    call("DELETE", v1 + "/markers/tiers/{tier}", v1 + "/markers/tiers/fs", want=200)
    call("DELETE", v1 + "/markers/prompts/{prompt}", v1 + "/markers/prompts/p-none", want=200)
    call("DELETE", v1 + "/markers", want=200)
    call("POST", v1 + "/shutdown", want=200)  # this server has no shutdown hook: it answers and keeps serving
    # Errors: each status a route documents, its body an ErrorBody.
    call("POST", v1 + "/probe", want=400, json={"tokens": "nope"})
    call("POST", v1 + "/settings", want=400, json={})
    call("POST", v1 + "/restore", want=401, json=PROMPT, token=False)
    call("POST", v1 + "/restores/{id}/abort", v1 + "/restores/req-nope/abort", want=404)
    call("DELETE", v1 + "/markers/tiers/{tier}", v1 + "/markers/tiers/ssd", want=400)
    # A rank that died: /health answers 503 with the same body, ok false.
    eng.ranks[1].dead = True
    unhealthy = call("GET", v1 + "/health", want=503, token=False)
    assert unhealthy["ok"] is False and unhealthy["unhealthy_ranks"] == [1]
    documented = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops if p != "/metrics"}
    left = documented - {(m, p) for m, p, _ in call.checked} - {("POST", v1 + "/scrub")}  # no scrub in the fakes
    assert left == set()


def test_an_answer_that_differs_from_its_schema_is_refused(served: tuple[FakeEngine, AdminServer], doc: dict) -> None:
    """The control: the same validation fails for a key renamed, a key added, a type changed or an enum value
    this API does not send."""
    _, server = served
    info = httpx.get(server.url + PREFIX + "/info", headers=AUTH, timeout=30).json()
    health = httpx.get(server.url + PREFIX + "/health", timeout=30).json()
    info_schema = _validator(doc, PREFIX + "/info", "GET", 200)
    health_schema = _validator(doc, PREFIX + "/health", "GET", 200)
    assert info_schema.is_valid(info) and health_schema.is_valid(health)
    renamed = {("window" if k == "W" else k): v for k, v in info.items()}
    assert not info_schema.is_valid(renamed)  # EngineInfo keeps a host's keys, but W is required
    assert not health_schema.is_valid(health | {"degraded": []})  # Health keeps no other key
    assert not health_schema.is_valid(health | {"ok": "yes"})
    rank = health["ranks"][0] | {"heartbeat_age_s": "soon"}
    assert not health_schema.is_valid(health | {"ranks": [rank]})
    assert not health_schema.is_valid(health | {"tiers": {"fs": health["tiers"]["fs"] | {"condition": 3}}})
    assert not info_schema.is_valid(health)  # a schema of another answer
