"""The admin server under hostile or broken clients, against a real embedded engine of its own (small limits so the
defences trigger quickly): JSON 400s for every malformed body, the token checked before a body is read, a body cap,
request deadlines, a connection cap, 405 for methods it does not serve, settings checked as `bsr engine up` checks
them, and owner-only files."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

try:
    from hypothesis.errors import Unsatisfiable
except ImportError:  # only the fuzz test needs it, and it skips without schemathesis
    Unsatisfiable = RuntimeError  # type: ignore[misc,assignment]

from bsr_cli.client import local_engine
from bsr_cli.loaders import builtin_registration

pytestmark = [pytest.mark.engine, pytest.mark.timeout(180)]
REG = builtin_registration("demo")
LIMITS = {"max_connections": 8, "request_deadline_s": 3.0, "idle_timeout_s": 3.0, "head_deadline_s": 2.0}
JSON = {"Content-Type": "application/json"}
MAX_TOKENS = 2048


class Hard:
    def __init__(self, url: str, token: str, state: Path) -> None:
        self.url, self.token, self.state = url, token, state
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def raw(self, data: bytes, *, timeout: float = 15.0) -> bytes:
        """Send raw bytes on a fresh connection and read until the server closes it (or `timeout`)."""
        with socket.create_connection(self.addr, timeout=timeout) as s:
            s.sendall(data)
            return _read_until_close(s)


def _read_until_close(s: socket.socket) -> bytes:
    out = b""
    while True:
        got = s.recv(65536)
        if not got:
            return out
        out += got


def _status_and_json(resp: bytes) -> tuple[int, dict]:
    head, _, body = resp.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, json.loads(body)


@pytest.fixture(scope="module")
def hard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hard]:
    from bsr_cli.engine import supervisor

    state = tmp_path_factory.mktemp("hard-engine")
    opts = supervisor.EngineOptions(
        REG, w=2, max_tokens=MAX_TOKENS, faults_enabled=True, fetch_timeout_s=2.0, admin_limits=LIMITS
    )
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        yield Hard(conn[0], conn[1], state)
    finally:
        supervisor.down(state)


# -- malformed bodies: 400 with a JSON error, never a 500 --------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "needle"),
    [
        ("/bsr/v1/probe", b"\xff\xfe\x00garbage", "not UTF-8"),
        ("/bsr/v1/probe", b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        ("/bsr/v1/probe", b'{"synthetic": {"n": NaN}}', "acceptable JSON"),
        ("/bsr/v1/probe", b'{"synthetic": {"n": 10}, "exclude_tiers": "mooncake"}', "exclude_tiers"),
        ("/bsr/v1/probe", b'{"synthetic": {"n": 10}, "exclude_tiers": [["fs"]]}', "exclude_tiers"),
        ("/bsr/v1/probe", b'{"tokens": [1.5, 2]}', "tokens"),
        ("/bsr/v1/probe", b'{"tokens": []}', "empty"),
        ("/bsr/v1/probe", b'{"tokens": ' + b"9" * 5000 + b"}", "acceptable JSON"),
        ("/bsr/v1/restore", b'{"synthetic": {"n": 10}, "exclude_tiers": [{"a": 1}]}', "exclude_tiers"),
        ("/bsr/v1/restore", b'{"synthetic": {"n": 10}, "stream": "yes"}', "stream"),
        ("/bsr/v1/requests", b'{"synthetic": {"n": 10}, "verify": 1}', "verify"),
        ("/bsr/v1/settings", b'{"budget_bytes": 1}', "below one chunk slot"),
        ("/bsr/v1/settings", b'{"budget_bytes": 1000000000000000000000000000000}', "exceeds the pool"),
        ("/bsr/v1/settings", b'{"W": 6}', "more than the pool"),
        ("/bsr/v1/settings", b'{"fs_concurrency": 6000000000}', "at most 256"),
        # W: at most the chunks of the longest prompt (2,048 tokens: 8 chunks of 256), never any integer.
        ("/bsr/v1/restore", b'{"synthetic": {"n": 10}, "W": 18446744073709551621}', "'W' must be at most 1048576"),
        ("/bsr/v1/requests", b'{"synthetic": {"n": 10}, "W": ' + b"9" * 4001 + b"}", "'W' must be at most"),
        ("/bsr/v1/restore", b'{"synthetic": {"n": 10}, "W": 9, "stream": false}', "8 chunks of this engine's longest"),
        ("/bsr/v1/requests", b'{"synthetic": {"n": 10}, "W": 9}', "8 chunks of this engine's longest prompt"),
        ("/bsr/v1/settings", b'{"W": 9}', "8 chunks of this engine's longest prompt"),
        ("/bsr/v1/settings", b'{"W": 18446744073709551621}', "'W' must be at most"),
        # The body is required, with at least one setting; none is nullable.
        ("/bsr/v1/settings", b"{}", "give at least one of"),
        ("/bsr/v1/settings", b"", "give at least one of"),
        ("/bsr/v1/settings", b'{"W": null}', "'W'"),
    ],
)
def test_malformed_bodies_get_400_json(hard: Hard, path: str, body: bytes, needle: str) -> None:
    r = httpx.post(hard.url + path, content=body, headers=hard.auth() | JSON, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["error"] in ("bad-request", "invalid-input") and needle in err["message"]


def test_bad_queries_get_400(hard: Hard) -> None:
    for path in ("/bsr/v1/events?wait=nan", "/bsr/v1/events?wait=-1", "/bsr/v1/snapshot?events_since=%C2%B2"):
        r = httpx.get(hard.url + path, headers=hard.auth(), timeout=30)
        assert r.status_code == 400 and r.json()["error"] == "invalid-input", (path, r.text)


def test_rejected_settings_change_nothing(hard: Hard) -> None:
    before = httpx.get(hard.url + "/bsr/v1/info", headers=hard.auth(), timeout=10).json()
    # fs_concurrency is fine, the budget is not: nothing may be applied.
    r = httpx.post(
        hard.url + "/bsr/v1/settings", json={"fs_concurrency": 3, "budget_bytes": 1}, headers=hard.auth(), timeout=10
    )
    assert r.status_code == 400
    after = httpx.get(hard.url + "/bsr/v1/info", headers=hard.auth(), timeout=10).json()
    assert after == before
    ok = httpx.post(hard.url + "/bsr/v1/settings", json={"W": 1}, headers=hard.auth(), timeout=10)
    assert ok.status_code == 200 and ok.json()["W"] == 1
    httpx.post(hard.url + "/bsr/v1/settings", json={"W": 2}, headers=hard.auth(), timeout=10).raise_for_status()


# -- methods -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["PUT", "PATCH", "TRACE", "OPTIONS", "HEAD", "BREW"])
def test_unknown_methods_get_405_json(hard: Hard, method: str) -> None:
    # `Connection: close`: the server hangs up after its answer, so the read ends there, not at the idle deadline.
    head = f"{method} /bsr/v1/settings HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    resp = hard.raw(head.encode())
    assert b"\r\nAllow: POST\r\n" in resp
    if method == "HEAD":  # an answer to HEAD has no body (RFC 9110 9.3.2): the status and Allow say it all
        head, _, body = resp.partition(b"\r\n\r\n")
        assert int(head.split(b" ", 2)[1]) == 405 and body == b""
        return
    status, err = _status_and_json(resp)
    assert status == 405 and err["error"] == "method-not-allowed"


def test_a_known_path_with_the_wrong_method_is_405_with_allow(hard: Hard) -> None:
    r = httpx.get(hard.url + "/bsr/v1/settings", headers=hard.auth(), timeout=10)
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"] == "method-not-allowed"
    r = httpx.delete(hard.url + "/bsr/v1/faults", timeout=10)  # the token is still needed for the right method
    assert r.status_code == 401


# -- bodies: the token first, a cap, no chunked uploads --------------------------------------------------------------


def test_the_token_is_checked_before_the_body_is_read(hard: Hard) -> None:
    """A stranger announcing 50 MiB gets 401 at once; the server never waits for (or buffers) the body."""
    head = b"POST /bsr/v1/settings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    resp = hard.raw(head + b"Content-Length: 52428800\r\n\r\n{", timeout=10)
    status, body = _status_and_json(resp)
    assert status == 401 and body["error"] == "unauthorized"
    assert b"Connection: close" in resp  # the unread body is never parsed as a next request


def test_bodies_over_the_cap_get_413_unread(hard: Hard) -> None:
    from bsr_cli.server.admin import BODY_BYTES_PER_TOKEN, BODY_OVERHEAD

    cap = BODY_OVERHEAD + BODY_BYTES_PER_TOKEN * MAX_TOKENS
    head = (
        f"POST /bsr/v1/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {hard.token}\r\n"
        f"Content-Length: {cap + 1}\r\n\r\n"
    ).encode()
    status, body = _status_and_json(hard.raw(head + b"{", timeout=10))
    assert status == 413 and str(f"{cap:,}") in body["message"]
    # The longest prompt, pretty-printed with the largest ids, still fits.
    prompt = json.dumps({"tokens": [(1 << 32) - 1] * MAX_TOKENS}, indent=4).encode()
    assert len(prompt) <= cap
    r = httpx.post(hard.url + "/bsr/v1/probe", content=prompt, headers=hard.auth() | JSON, timeout=30)
    assert r.status_code == 200 and r.json()["committable_tokens"] == 0


def test_chunked_bodies_get_411(hard: Hard) -> None:
    head = (
        f"POST /bsr/v1/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {hard.token}\r\n"
        "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    ).encode()
    status, body = _status_and_json(hard.raw(head, timeout=10))
    assert status == 411 and "Content-Length" in body["message"]


# -- slow and idle clients, the connection cap -----------------------------------------------------------------------


def test_a_half_sent_request_is_cut_off(hard: Hard) -> None:
    """Headers trickled a byte at a time never complete: the deadline (3 s here) closes the connection."""
    with socket.create_connection(hard.addr, timeout=20) as s:
        s.sendall(b"GET /bsr/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(30):  # up to ~30 s of trickling; the server must hang up long before
            try:
                s.sendall(b"X")
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed, "the server kept a half-sent request open"


def test_an_idle_connection_is_closed(hard: Hard) -> None:
    with socket.create_connection(hard.addr, timeout=20) as s:
        assert s.recv(1) == b""  # closed by the server well within our 20 s


def test_idle_strangers_cannot_take_the_operators_connection(hard: Hard) -> None:
    """Far more tokenless idle sockets than the engine serves at once (it used to answer 503 once 8 were open): the
    operator's request is answered, and every stranger's socket is closed by the engine (dropped as busy past the
    per-client cap, or at the head deadline)."""
    idle = [socket.create_connection(hard.addr, timeout=20) for _ in range(40)]
    try:
        r = httpx.get(hard.url + "/bsr/v1/info", headers=hard.auth(), timeout=10)
        assert r.status_code == 200, r.text
        for s in idle:
            answer = _read_until_close(s)  # returns once the engine closes it (the socket timeout bounds it)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:80]
    finally:
        for s in idle:
            s.close()


# -- files -----------------------------------------------------------------------------------------------------------


def test_everything_under_the_state_dir_is_owner_only(hard: Hard) -> None:
    r = httpx.post(hard.url + "/bsr/v1/requests", json={"synthetic": {"n": 600, "seed": 5}}, headers=hard.auth())
    assert r.status_code == 200 and r.json()["hash_ok"] is True  # the fs tier now holds objects
    objects = [p for p in (hard.state / "fs-tier").rglob("*") if p.is_file()]
    assert objects, "the filesystem tier stored nothing"
    loose = []
    for root, dirs, files in os.walk(hard.state):
        for name in [*dirs, *files, ""]:
            p = Path(root, name)
            mode = stat.S_IMODE(p.lstat().st_mode)
            if mode & 0o077:
                loose.append(f"{p.relative_to(hard.state)} {oct(mode)}")
    assert not loose, loose


def test_status_shows_exposed_ports(hard: Hard, bsr, monkeypatch: pytest.MonkeyPatch) -> None:
    from bsr_cli.engine import supervisor

    st = supervisor.status(hard.state)
    admin_port = int(hard.url.rsplit(":", 1)[1])
    assert any(d.process == "engine" and d.port == admin_port and not d.exposed for d in st.listening)
    # Mooncake's transfer engine binds wildcard addresses (the segment holder's): status says so, not hides it.
    assert any(d.process == "segment_holder" and d.exposed for d in st.listening)
    assert all(d.exposed == (not d.address.startswith("127.") and d.address != "::1") for d in st.listening)
    assert st.to_wire()["exposed"] == [dataclasses.asdict(d) for d in st.listening if d.exposed]
    monkeypatch.setenv("BSR_STATE_DIR", str(hard.state))
    r = bsr("engine", "status")
    assert r.code == 0 and "exposed beyond loopback:" in r.out and "segment_holder" in r.out, r.out


def test_up_refuses_other_options_on_a_running_engine(hard: Hard) -> None:
    from bsr_cli.engine import supervisor
    from bsr_cli.errors import InvalidInput

    same = supervisor.EngineOptions(
        REG, w=2, max_tokens=MAX_TOKENS, faults_enabled=True, fetch_timeout_s=2.0, admin_limits=LIMITS
    )
    assert supervisor.up(hard.state, same).already_running is True
    other = supervisor.EngineOptions(REG, w=2, max_tokens=MAX_TOKENS, faults_enabled=True, fetch_timeout_s=5.0)
    with pytest.raises(InvalidInput, match=r"other options: fetch_timeout_s 2\.0 → 5\.0") as e:
        supervisor.up(hard.state, other)
    assert e.value.hint and "--restart" in e.value.hint
    assert httpx.get(hard.url + "/bsr/v1/health", timeout=10).status_code == 200  # the running one is untouched


# -- schemathesis: generated requests for every operation, no 5xx, nothing undocumented ---------------------------
# Last in this module: it arms faults and changes settings on this module's engine.

# Per operation, valid requests (plus half as many invalid ones). The suite runs 50; the release check runs 200 or
# more (BSR_FUZZ_EXAMPLES=200, recorded in docs/admin-api.md).
FUZZ_EXAMPLES = int(os.environ.get("BSR_FUZZ_EXAMPLES", "50"))


@pytest.mark.timeout(max(180, 12 * FUZZ_EXAMPLES))
def test_fuzzing_every_operation_finds_no_server_error_and_no_drift(hard: Hard) -> None:
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import (
        content_type_conformance,
        negative_data_rejection,
        not_a_server_error,
        positive_data_acceptance,
        response_schema_conformance,
        status_code_conformance,
    )

    # The engine's own document: docs/openapi.json narrowed to this engine's prompt limit, ranks, groups, tiers,
    # windows and pool, so that every request valid against it must be accepted (positive_data_acceptance).
    served = httpx.get(hard.url + "/bsr/v1/openapi.json", headers=hard.auth(), timeout=30)
    assert served.status_code == 200
    schema = schemathesis.openapi.from_dict(served.json())
    conformance = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    ran: dict[str, int] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path.endswith("/shutdown"):
            continue  # would stop the engine under test; its 401 and 200 are checked at the end
        for mode, examples, checks in (
            (GenerationMode.POSITIVE, FUZZ_EXAMPLES, [*conformance, positive_data_acceptance]),
            (GenerationMode.NEGATIVE, FUZZ_EXAMPLES // 2, [*conformance, negative_data_rejection]),
        ):
            _fuzz(
                hard,
                op,
                mode,
                examples,
                checks,
                ran,
                settings(
                    max_examples=examples,
                    deadline=None,
                    database=None,
                    derandomize=True,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=list(HealthCheck),
                ),
                given,
            )
    with httpx.Client(timeout=10) as c:
        c.delete(hard.url + "/bsr/v1/faults", headers=hard.auth()).raise_for_status()
    positive = {k.removesuffix(" positive"): n for k, n in ran.items() if k.endswith("positive")}
    assert len(positive) == 22, ran
    # Every operation with a body or a free-form parameter ran the full count; the others have fewer distinct
    # requests than that (GET /health has exactly one), and hypothesis stops once it has tried them all.
    free = [k for k in positive if k.startswith("POST") and "reset-peak" not in k] + [
        "GET /bsr/v1/events",
        "GET /bsr/v1/snapshot",
    ]
    assert all(positive[k] >= FUZZ_EXAMPLES for k in free), positive
    r = httpx.post(hard.url + "/bsr/v1/shutdown", timeout=10)
    assert r.status_code == 401
    shutdown = schema["/bsr/v1/shutdown"]["POST"]
    r = httpx.post(hard.url + "/bsr/v1/shutdown", headers=hard.auth(), timeout=10)
    assert r.status_code == 200 and r.json() == {"ok": True}
    shutdown.validate_response(r)
    from bsr_cli.engine import supervisor

    # The engine stops its ranks and every service started for it (Mooncake's master and segment holder), then
    # exits (bounded: 60 s); nothing it started is left running.
    procs = supervisor.status(hard.state).processes
    assert {p.name for p in procs} >= {"engine", "rank0", "rank1", "mooncake_master", "segment_holder"}
    for _ in range(600):
        if not any(p.alive for p in supervisor.status(hard.state).processes):
            break
        time.sleep(0.1)
    left = [p for p in supervisor.status(hard.state).processes if p.alive]
    assert not left, f"still running after /shutdown: {left}"


def _fuzz(hard: Hard, op, mode, examples: int, checks: list, ran: dict[str, int], cfg, given) -> None:
    headers = {"Authorization": f"Bearer {hard.token}"} if op.security else None

    # Valid long-polls of /events would each wait up to 30 s for an event: valid ones are generated with wait=0.
    pinned = {"query": {"wait": 0}} if op.path.endswith("/events") and mode.value == "positive" else {}

    @cfg
    @given(case=op.as_strategy(generation_mode=mode, **pinned))
    def run(case) -> None:
        # A negative case may be negative only by leaving the token out: adding ours would make it valid.
        sent = headers
        components = getattr(case.meta, "components", None) or {}
        if any(loc.value == "header" and info.mode.value == "negative" for loc, info in components.items()):
            sent = None
        resp = case.call(base_url=hard.url, headers=sent, timeout=30)
        case.validate_response(resp, checks=checks, headers=sent)
        key = f"{op.label} {mode.value}"
        ran[key] = ran.get(key, 0) + 1

    try:
        run()
    except Unsatisfiable:
        if mode.value == "positive":
            raise  # an operation without inputs has no invalid request to generate; every one has a valid one
