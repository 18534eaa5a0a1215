"""The admin server against hostile or careless clients, in-process: the real uvicorn-served app and the real CLI
over fake ranks. Tokenless sockets cannot lock the operator out (up to 1,500 of them from 150 addresses, held by a
process of their own), serving slots with and without the token are kept apart, and the request head is checked
before anything else (host, origin, duplicated headers, size, media type, the token on reads)."""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")  # the admin API is the engine extra's

from bsr_cli.errors import ExitCode
from bsr_cli.server.admin import PREFIX, AdminServer
from unit.fixtures import FakeEngine, build_engine

TOKEN = "guard-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[FakeEngine, AdminServer]]]:
    """Start an admin server over a fake engine with the given AdminServer options."""
    started: list[tuple[FakeEngine, AdminServer]] = []

    def start(**options: object) -> tuple[FakeEngine, AdminServer]:
        eng = build_engine(fetch_timeout_s=20.0)
        server = AdminServer(eng.coordinator, token=TOKEN, **options)  # type: ignore[arg-type]
        server.start()
        started.append((eng, server))
        return eng, server

    yield start
    for eng, server in started:
        server.stop()
        for r in eng.ranks:
            r.close()


def _addr(server: AdminServer) -> tuple[str, int]:
    return server.host, server.port


def _raw(server: AdminServer, data: bytes) -> tuple[int, dict]:
    """Send raw bytes on a fresh connection; the status and JSON body of the answer."""
    with socket.create_connection(_addr(server), timeout=20) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _length(out):
            got = s.recv(65536)
            if not got:
                break
            out += got
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def _length(out: bytes) -> int:
    for line in out.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1 << 30


class SlowLoris:
    """``n`` tokenless sockets that each started a request head and add one byte to it now and then, reopened as
    soon as the server closes one (what an attacker holding the engine's connections does)."""

    def __init__(self, addr: tuple[str, int], n: int) -> None:
        self.addr, self.n = addr, n
        self.stop = threading.Event()
        self.reopened = 0
        self.socks = [self._open() for _ in range(n)]
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _open(self) -> socket.socket:
        s = socket.create_connection(self.addr, timeout=5)
        s.sendall(b"GET /bsr/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        s.setblocking(False)
        return s

    def _trickle(self) -> None:
        while not self.stop.wait(0.2):
            for i, s in enumerate(self.socks):
                try:
                    if s.recv(4096) == b"":
                        raise ConnectionResetError
                    raise ConnectionResetError  # it was answered (503 busy): it is closed next
                except BlockingIOError:
                    try:
                        s.send(b"X")
                    except OSError:
                        self._replace(i, s)
                except OSError:
                    self._replace(i, s)

    def _replace(self, i: int, s: socket.socket) -> None:
        s.close()
        try:
            self.socks[i] = self._open()
            self.reopened += 1
        except OSError:
            pass

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=10)
        for s in self.socks:
            s.close()


@pytest.mark.timeout(300)  # 50 CLI runs against 200 churning sockets: seconds alone, longer on a busy machine
def test_tokenless_slow_sockets_cannot_lock_out_an_authenticated_status(
    serve: Callable[..., tuple[FakeEngine, AdminServer]], bsr, monkeypatch: pytest.MonkeyPatch
) -> None:
    """200 tokenless sockets trickling request heads, reopened as fast as the server drops them: `bsr status`
    with the token answers 50 times out of 50 (it used to exit 9, every connection slot taken)."""
    _, server = serve()
    monkeypatch.setenv("BSR_ENGINE", server.url)
    monkeypatch.setenv("BSR_TOKEN", TOKEN)
    loris = SlowLoris(_addr(server), 200)
    try:
        codes = [bsr("status", "--json").code for _ in range(50)]
    finally:
        loris.close()
    assert codes == [0] * 50, codes


class Strangers:
    """tests/unit/loris.py in a process of its own (the attack must not share this interpreter's lock with the
    server it attacks): ``count`` slow tokenless sockets spread over ``addresses`` loopback source addresses, half of
    them trickling a request head, half sending nothing, each reopened as soon as the server closes it."""

    def __init__(self, server: AdminServer, count: int, addresses: int) -> None:
        loris = Path(__file__).with_name("loris.py")
        args = [sys.executable, str(loris), server.host, str(server.port), str(count), str(addresses)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ready, self.churned = threading.Event(), threading.Event()
        self.summary: dict[str, int] = {}
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("ready"):
                self.ready.set()
            elif line.startswith("churned"):
                self.churned.set()
            elif line.startswith("{"):
                self.summary = json.loads(line)

    def close(self) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.reader.join(timeout=10)
        return self.summary


def _operator_reads(server: AdminServer, n: int) -> list[int | str]:
    """``n`` authenticated GET /info at once, each on a connection of its own (as n CLI runs would): what each got."""

    def one(_: int) -> int | str:
        try:
            return httpx.get(server.url + f"{PREFIX}/info", headers=AUTH, timeout=120).status_code
        except httpx.HTTPError as e:
            return type(e).__name__

    with ThreadPoolExecutor(max_workers=n) as pool:
        return list(pool.map(one, range(n)))


@pytest.mark.timeout(420)  # 1,500 sockets opened, held and reopened on a two-core machine shared with other tests
@pytest.mark.parametrize("caps", [{}, {"max_waiting": 128}], ids=["default-caps", "caps-below-the-crowd"])
def test_the_operator_is_answered_past_1500_slow_sockets_from_150_addresses(
    serve: Callable[..., tuple[FakeEngine, AdminServer]], caps: dict[str, int]
) -> None:
    """1,500 tokenless sockets from 127.0.0.2 ... 127.0.0.151 held open (the server holds them all by default; with
    its cap at 128 it closes the oldest for every newcomer and the strangers reopen at once): every authenticated
    GET /info, 19 at a time, is answered 200, while the crowd stands and while the server closes and the strangers
    reopen as many sockets as they hold. None is dropped or answered 503 busy (the server used to close the
    operator's own connection, whose head the flooded event loop had not read yet, as the oldest)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2500:
        pytest.skip(f"1,500 sockets on each side need more open files than the hard limit of {hard}")
    _, server = serve(**caps)  # it raises this process's soft limit to hold what its caps let in
    strangers = Strangers(server, 1500, 150)
    codes: list[int | str] = []
    try:
        assert strangers.ready.wait(120), "the 1,500 sockets never all connected"
        codes += _operator_reads(server, 19)
        deadline = time.monotonic() + 180
        # On (19 at a time, a quarter second apart) until the server has closed as many of the strangers' sockets
        # as they hold, at their head deadline or for newer ones past the cap, and they reopened them.
        while not strangers.churned.wait(0.25) and time.monotonic() < deadline:
            codes += _operator_reads(server, 19)
        assert strangers.churned.is_set(), "the strangers' sockets were never closed and reopened"
        codes += _operator_reads(server, 19)
    finally:
        summary = strangers.close()
    assert summary["reopened"] >= 1500, summary
    assert codes == [200] * len(codes), Counter(codes)


def test_serving_slots_with_and_without_the_token_are_kept_apart(
    serve: Callable[..., tuple[FakeEngine, AdminServer]], bsr, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests held mid-body fill the slots: past the tokenless ones a stranger gets 503 busy while the operator is
    still served; past the operator's, the CLI retries reads, then exits with its own code for busy."""
    _, server = serve(max_connections=2, max_anonymous=2, request_deadline_s=60.0, idle_timeout_s=60.0)

    def held(auth: bool) -> socket.socket:
        s = socket.create_connection(_addr(server), timeout=20)
        token = f"Authorization: Bearer {TOKEN}\r\n" if auth else ""
        path = "/bsr/v1/settings" if auth else "/bsr/v1/health"
        method = "POST" if auth else "GET"
        s.sendall(
            f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{token}Content-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n".encode()
        )  # the head, and not the body: the request holds its slot while the server waits for the body
        return s

    strangers = [held(auth=False) for _ in range(2)]
    try:
        with httpx.Client(base_url=server.url, timeout=20) as http:
            _wait_for(lambda: server.guard.serving[False] == 2)
            r = http.get(f"{PREFIX}/health")
            assert r.status_code == 503 and r.json()["error"] == "busy" and r.headers["retry-after"] == "1"
            assert http.get(f"{PREFIX}/info", headers=AUTH).status_code == 200  # the operator's slots are free
            operators = [held(auth=True) for _ in range(2)]
            try:
                _wait_for(lambda: server.guard.serving[True] == 2)
                r = http.get(f"{PREFIX}/info", headers=AUTH)
                assert r.status_code == 503 and r.json()["error"] == "busy"
                monkeypatch.setenv("BSR_ENGINE", server.url)
                monkeypatch.setenv("BSR_TOKEN", TOKEN)
                res = bsr("pool")
                assert res.code == ExitCode.ENGINE_BUSY == 15, (res.code, res.err)
                assert "busy" in res.err
            finally:
                for s in operators:
                    s.close()
            _wait_for(lambda: server.guard.serving[True] == 0)
            assert http.get(f"{PREFIX}/info", headers=AUTH).status_code == 200
    finally:
        for s in strangers:
            s.close()


def _wait_for(cond: Callable[[], bool]) -> None:
    done = threading.Event()
    for _ in range(400):  # bounded: 20 s
        if cond():
            return
        done.wait(0.05)
    assert cond()


# -- the head: host, origin, duplicates, size; the token on every read; JSON bodies only --------------------------


def test_a_foreign_host_or_origin_is_refused(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    _, server = serve()
    with httpx.Client(base_url=server.url, timeout=20) as http:
        r = http.get(f"{PREFIX}/info", headers=AUTH | {"Host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"] == "forbidden-host"
        # A cross-origin, tokenless, text/plain POST (what a web page can send without a preflight) does not run.
        r = http.post(
            f"{PREFIX}/probe",
            content=b'{"synthetic": {"n": 10}}',
            headers={"Origin": "http://evil.example", "Content-Type": "text/plain"},
        )
        assert r.status_code == 403 and r.json()["error"] == "forbidden-origin"
        r = http.get(f"{PREFIX}/info", headers=AUTH | {"Origin": "null"})
        assert r.status_code == 403
        # Loopback names and the engine's own origin are served.
        for host in ("localhost", f"127.0.0.1:{server.port}", "[::1]:80"):
            assert http.get(f"{PREFIX}/info", headers=AUTH | {"Host": host}).status_code == 200, host
        ok = http.get(f"{PREFIX}/info", headers=AUTH | {"Origin": f"http://localhost:{server.port}"})
        assert ok.status_code == 200


def test_an_allowed_host_is_served(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    _, server = serve(allowed_hosts=["bsr.internal"])
    with httpx.Client(base_url=server.url, timeout=20) as http:
        assert http.get(f"{PREFIX}/info", headers=AUTH | {"Host": "bsr.internal:8080"}).status_code == 200
        assert http.get(f"{PREFIX}/info", headers=AUTH | {"Host": "other.internal"}).status_code == 403


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/info"),
        ("GET", "/registration"),
        ("GET", "/snapshot"),
        ("GET", "/pool"),
        ("GET", "/events"),
        ("GET", "/faults"),
        ("GET", "/markers"),
        ("POST", "/probe"),
    ],
)
def test_every_read_needs_the_right_token(
    serve: Callable[..., tuple[FakeEngine, AdminServer]], method: str, path: str
) -> None:
    _, server = serve()
    body = {"json": {"synthetic": {"n": 10}}} if method == "POST" else {}
    with httpx.Client(base_url=server.url, timeout=20) as http:
        assert http.request(method, PREFIX + path, **body).status_code == 401
        wrong = http.request(method, PREFIX + path, headers={"Authorization": "Bearer wrong"}, **body)
        assert wrong.status_code == 401 and wrong.json()["error"] == "unauthorized"
        assert http.request(method, PREFIX + path, headers=AUTH, **body).status_code == 200
        assert http.get(f"{PREFIX}/health").status_code == 200  # the one open route


def test_metrics_need_the_token_unless_served_openly(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    _, closed = serve()
    _, open_ = serve(open_metrics=True)
    assert httpx.get(closed.url + "/metrics", timeout=20).status_code == 401
    assert httpx.get(closed.url + "/metrics", headers=AUTH, timeout=20).status_code == 200
    assert httpx.get(open_.url + "/metrics", timeout=20).status_code == 200
    assert httpx.get(open_.url + f"{PREFIX}/info", timeout=20).status_code == 401  # only /metrics is opened


def test_ambiguous_requests_are_refused(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    eng, server = serve()
    budget = eng.coordinator.settings.budget_bytes
    # A key given twice: never "the last one wins".
    body = b'{"budget_bytes": 1, "budget_bytes": %d}' % budget
    r = httpx.post(server.url + f"{PREFIX}/settings", content=body, headers=AUTH | _JSON, timeout=20)
    assert r.status_code == 400 and "more than once" in r.json()["message"], r.text
    nested = b'{"synthetic": {"n": 10, "n": 20}}'
    r = httpx.post(server.url + f"{PREFIX}/probe", content=nested, headers=AUTH | _JSON, timeout=20)
    assert r.status_code == 400 and "'n'" in r.json()["message"]
    # Two Authorization headers, a wrong one first and the right one second.
    head = (
        f"GET {PREFIX}/info HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer wrong\r\n"
        f"Authorization: Bearer {TOKEN}\r\n\r\n"
    )
    status, err = _raw(server, head.encode())
    assert status == 400 and "authorization header is given more than once" in err["message"]
    # A query parameter twice, or one the route does not take.
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=20) as http:
        r = http.get(f"{PREFIX}/events?since=5&since=0")
        assert r.status_code == 400 and "more than once" in r.json()["message"]
        r = http.get(f"{PREFIX}/snapshot?health=0&helth=1")
        assert r.status_code == 400 and "unknown query parameter 'helth'" in r.json()["message"]
        assert http.get(f"{PREFIX}/snapshot?health=0&events_since=0").status_code == 200
        # A list parameter repeats by design (`bsr explain` asks for several event kinds at once).
        r = http.get(f"{PREFIX}/events?since=0&kind=restore_started&kind=restore_committed")
        assert r.status_code == 200, r.text


_JSON = {"Content-Type": "application/json"}


def test_bodies_must_be_json(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    _, server = serve()
    body = b'{"synthetic": {"n": 10}}'
    for media in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = httpx.post(server.url + f"{PREFIX}/probe", content=body, headers=AUTH | {"Content-Type": media}, timeout=20)
        assert r.status_code == 415 and "application/json" in r.json()["message"], media
    ok = httpx.post(
        server.url + f"{PREFIX}/probe",
        content=body,
        headers=AUTH | {"Content-Type": "application/json; charset=utf-8"},
        timeout=20,
    )
    assert ok.status_code == 200


def test_heads_over_16_kib_are_refused(serve: Callable[..., tuple[FakeEngine, AdminServer]]) -> None:
    """Sent whole (h11's own cap only applies to a head still arriving) or trickled, a head over 16 KiB is refused
    with a JSON error; one just under is served."""
    _, server = serve()
    big = "a" * (64 << 10)
    status, err = _raw(server, f"GET {PREFIX}/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {big}\r\n\r\n".encode())
    assert status in (400, 431) and "16" in (err["message"] + (err.get("hint") or "")), err
    pad = "a" * (15 << 10)
    status, _ = _raw(server, f"GET {PREFIX}/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: {pad}\r\n\r\n".encode())
    assert status == 200


def test_a_client_with_many_kept_alive_connections_is_served(
    serve: Callable[..., tuple[FakeEngine, AdminServer]],
) -> None:
    """More idle kept-alive connections from one address than the waiting cap allows: the oldest are closed
    quietly, and a pooled client reusing its connections sees every answer (no stray 'busy')."""
    _, server = serve(max_waiting_per_client=4)
    from concurrent.futures import ThreadPoolExecutor

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=20) as http:

        def calls(_: int) -> list[int]:
            return [http.get(f"{PREFIX}/info").status_code for _ in range(5)]

        with ThreadPoolExecutor(max_workers=16) as pool:
            codes = [c for batch in pool.map(calls, range(16)) for c in batch]
    assert codes == [200] * 80, sorted(set(codes))


def _get_on(s: socket.socket, path: str) -> int:
    """One GET with the token on the kept-alive socket ``s``; its status (0: the server had closed the connection)."""
    try:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n\r\n".encode())
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < _length(out):
            got = s.recv(65536)
            if not got:
                return 0
            out += got
    except ConnectionError:
        return 0
    return int(out.split(b" ", 2)[1])


def test_a_kept_alive_connection_is_closed_for_idleness_only_after_the_idle_timeout_since_its_last_answer(
    serve: Callable[..., tuple[FakeEngine, AdminServer]],
) -> None:
    """A connection that carried requests for longer than the idle timeout, idle between them for less, stays open:
    the idle time counts from the last answer, not from when the connection or a request arrived. (The idle waits
    are the condition under test, not synchronisation: the last one is 1.6 s of the 4 s timeout.)"""
    idle_s = 4.0
    _, server = serve(idle_timeout_s=idle_s)
    pause = threading.Event()
    with socket.create_connection(_addr(server), timeout=30) as s:
        opened = time.monotonic()
        assert _get_on(s, f"{PREFIX}/info") == 200
        pause.wait(0.7 * idle_s)
        assert _get_on(s, f"{PREFIX}/info") == 200
        answered = time.monotonic()
        # Past the idle timeout since the connection opened, well within it since the last answer.
        pause.wait(max(opened + 1.1 * idle_s, answered + 0.1 * idle_s) - time.monotonic())
        assert _get_on(s, f"{PREFIX}/info") == 200, "closed while idle for less than the idle timeout"
        # Negative control: left idle, the connection is closed (the read returns at the server's close).
        assert s.recv(1) == b""


def _send_whole_then_read(server: AdminServer, head: bytes, body: bytes) -> tuple[int, dict]:
    """Send a request's head and its whole body, as a client that reads only once it has sent everything does, then
    read the answer. A server that closed without reading the body resets the connection: sendall or recv raises."""
    with socket.create_connection(_addr(server), timeout=60) as s:
        s.sendall(head + body)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while got := s.recv(65536):
            out += got
    head_out, _, body_out = out.partition(b"\r\n\r\n")
    return int(head_out.split(b" ", 2)[1]), json.loads(body_out)


@pytest.mark.timeout(120)
def test_a_body_over_the_cap_is_answered_413_and_the_client_reads_it(
    serve: Callable[..., tuple[FakeEngine, AdminServer]],
) -> None:
    """A 10 MB body (the cap is 160 KiB here) is answered 413 before it is read, and a client that sends all of it
    before reading reads that answer: the server reads and drops the rest after answering instead of closing under
    it (the connection used to be reset while the client was still sending). The same for a chunked body's 411."""
    _, server = serve()
    body = b'{"tokens": [' + b"1," * (5_000_000 - 1) + b"1]}"
    assert len(body) > 60 * server.max_body
    head = (
        f"POST {PREFIX}/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, err = _send_whole_then_read(server, head, body)
    assert status == 413 and "over this engine's limit" in err["message"], err
    chunk = b"x" * 65536
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(160)) + b"0\r\n\r\n"
    head = (
        f"POST {PREFIX}/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    status, err = _send_whole_then_read(server, head, chunked)
    assert status == 411 and "send Content-Length" in err["message"], err
    # Without the token the same body is refused (401) just as cleanly.
    head = (
        f"POST {PREFIX}/probe HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    status, err = _send_whole_then_read(server, head, body)
    assert status == 401 and err["error"] == "unauthorized"


def test_a_process_short_of_open_files_queues_and_waits_fewer() -> None:
    """Where the hard limit on open files cannot hold every connection the caps let in, the request queue and the
    waiting caps shrink to fit it (an accept that fails for want of a descriptor would stop every accept for a
    second); where it can, the soft limit is raised to hold them. In a process of its own: the limit is per process."""
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, int(sys.argv[1])))\n"
        "from bsr_cli.server.admin import AdminServer\n"
        "from unit.fixtures import build_engine\n"
        "eng = build_engine()\n"
        "s = AdminServer(eng.coordinator, token='t')\n"
        "print(s.max_queued, s.max_waiting, resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "for r in eng.ranks: r.close()\n"
    )
    tests = str(Path(__file__).resolve().parents[1])

    def caps(hard: int) -> list[int]:
        out = subprocess.run(
            [sys.executable, "-c", code, str(hard)], capture_output=True, text=True, timeout=120, cwd=tests
        )
        assert out.returncode == 0, out.stderr
        return [int(x) for x in out.stdout.split()]

    queued, waiting, soft = caps(1024)
    assert (queued, waiting, soft) == (220, 110, 1024)  # 1,024 - 512 kept for the engine - 72 slots = 440 to share
    need = 72 + 1024 + 2 * 2048 + 512
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY or hard >= need:
        queued, waiting, soft = caps(need if hard == resource.RLIM_INFINITY else hard)
        assert (queued, waiting, soft) == (1024, 2048, need)  # raised from 256 to what the caps need
