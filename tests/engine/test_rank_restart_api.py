"""The admin API while a rank process dies and is started again, on a real engine of its own: no answer is a 5xx but
503 ``rank-restarting`` with Retry-After, no answer hands out half-restored KV, and settings are all or nothing
across ranks (a change sent while the rank is down, or one a rank fails, leaves every rank as `/info` says)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from bsr_cli.client import local_engine
from bsr_cli.loaders import builtin_registration

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
REG = builtin_registration("demo")
V1 = "/bsr/v1"
PROMPT = {"synthetic": {"n": 600, "seed": 4711}}
TOTAL = 200  # answers sent while the rank is killed and started again, at least
# A frozen rank is judged after the stall time (the fetch timeout): long enough that a change sent right after the
# freeze always reaches the frozen rank before the engine could judge it, on a busy machine too.
FETCH_TIMEOUT_S = 10.0


@dataclass
class Engine:
    url: str
    token: str
    state: Path

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def rank_pid(self, rank: int) -> int:
        from bsr_cli.engine import supervisor

        return next(p.pid for p in supervisor.status(self.state).processes if p.name == f"rank{rank}")


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    from bsr_cli.engine import supervisor

    state = tmp_path_factory.mktemp("restart-engine")
    opts = supervisor.EngineOptions(REG, w=2, max_tokens=2048, fetch_timeout_s=FETCH_TIMEOUT_S)
    try:
        supervisor.up(state, opts)
        conn = local_engine.connection(state)
        assert conn is not None
        yield Engine(conn[0], conn[1], state)
    finally:
        supervisor.down(state)


def _until(cond: Callable[[], bool], what: str, limit_s: float = 240.0) -> None:
    """Wait for ``cond`` (polled; bounded), failing with ``what``."""
    pause = threading.Event()
    for _ in range(int(limit_s / 0.2)):
        if cond():
            return
        pause.wait(0.2)
    assert cond(), what


@dataclass
class Answer:
    """One answer as the client saw it: for a stream, the status its error line carries (200 with a result)."""

    what: str
    status: int
    retry_after: str | None
    body: Any


def _send(http: httpx.Client, method: str, path: str, body: dict[str, Any] | None = None) -> Answer:
    r = http.request(method, V1 + path, json=body)
    if r.headers.get("content-type", "").startswith("application/x-ndjson"):
        last = json.loads(r.text.splitlines()[-1])
        status = int(last.get("status", 500)) if last["type"] == "error" else r.status_code
        return Answer(f"{method} {path} stream", status, None, last.get("result", last))
    return Answer(f"{method} {path}", r.status_code, r.headers.get("retry-after"), r.json())


def _budgets(http: httpx.Client) -> tuple[int, list[int | None]]:
    """/info's budget and each rank's as /pool reads it (None: the rank did not answer)."""
    info = http.get(V1 + "/info").json()["budget_bytes"]
    ranks = http.get(V1 + "/pool").json()["ranks"]
    return info, [(r.get("pool") or {}).get("budget_bytes") for r in ranks]


@dataclass
class Traffic:
    """Requests of every kind from a few threads, and settings changes from one (so each change's effect can be
    read back unraced), until told to stop."""

    engine: Engine
    budgets: tuple[int, int]
    answers: list[Answer] = field(default_factory=list)
    settings_seen: list[str] = field(default_factory=list)  # a change whose effect differs from its answer
    applied: int | None = None  # the budget the last change answered 200 with
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.engine.url, headers=self.engine.auth(), timeout=120)

    def record(self, a: Answer) -> None:
        with self.lock:
            self.answers.append(a)

    def requests(self, offset: int) -> None:
        mix: list[tuple[str, str, dict[str, Any] | None]] = [
            ("GET", "/info", None),
            ("POST", "/restore", PROMPT | {"stream": False}),
            ("GET", "/pool", None),
            ("POST", "/probe", PROMPT),
            ("POST", "/requests", PROMPT),
            ("GET", "/health", None),
            ("POST", "/restore", PROMPT),
            ("POST", "/requests", PROMPT | {"stream": True}),
        ]
        with self.client() as http:
            for method, path, body in itertools.islice(itertools.cycle(mix), offset, None):
                if self.stop.is_set():
                    return
                self.record(_send(http, method, path, body))

    def settings(self) -> None:
        with self.client() as http:
            for value in itertools.cycle(self.budgets):
                if self.stop.is_set():
                    return
                before, _ = _budgets(http)
                a = _send(http, "POST", "/settings", {"budget_bytes": value})
                self.record(a)
                info, ranks = _budgets(http)
                self.record(Answer("GET /info+/pool", 200, None, {"info": info, "ranks": ranks}))
                want = value if a.status == 200 else before
                if a.status == 200:
                    self.applied = value
                if info != want or any(b not in (None, want) for b in ranks):
                    self.settings_seen.append(f"{a.status} for {value}: /info {info}, ranks {ranks}, want {want}")

    def count(self) -> int:
        with self.lock:
            return len(self.answers)


def _restarted(engine: Engine, after_seq: int) -> bool:
    r = httpx.get(
        engine.url + V1 + "/events",
        params={"since": after_seq, "kind": "rank_restarted"},
        headers=engine.auth(),
        timeout=30,
    )
    return any(e.get("rank") == 1 for e in r.json()["events"])


def _wrong(a: Answer) -> str | None:
    """What is wrong with an answer met while rank 1 was down and started again, or None."""
    if a.status == 503 and a.what == "GET /health":
        down = a.body.get("ranks_alive") == [True, False]
        if a.body.get("ok") is not False or (down and not (a.retry_after or "").isdigit()):
            return "a 503 health answer that is not the engine's health, or without Retry-After while rank 1 is down"
        return None
    if a.status == 503:
        body = a.body
        retry = body.get("retry_after_s")
        fine = (
            body.get("error") == "rank-restarting"
            and body.get("rank") == 1
            and isinstance(retry, int)
            and retry >= 1
            and "rank 1" in body.get("message", "")
            and (a.what.endswith("stream") or a.retry_after == str(retry))  # a stream's line has no header
        )
        return None if fine else "a 503 that is not rank-restarting naming rank 1 with when to retry"
    if a.status >= 500:
        return "a server error"
    if a.status == 200 and a.what.startswith(("POST /requests", "POST /restore")):
        outcome = a.body.get("outcome", "committed")
        if outcome == "committed" and a.body.get("hash_ok") is not True:
            return "KV handed out that is not the prompt's (hash_ok not true)"
        if outcome not in ("committed", "nothing_to_restore"):
            return f"a restore answered {outcome} instead of the rank's restart"
    elif a.status >= 400 and not a.what.startswith("POST /settings"):
        return "refused"
    return None


def test_a_rank_killed_and_started_again_never_makes_the_api_answer_a_server_error(own: Engine) -> None:
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=60) as http:
        info = http.get(V1 + "/info").json()
        assert http.post(V1 + "/requests", json=PROMPT).json()["hash_ok"] is True  # both tiers hold it now
        last_seq = http.get(V1 + "/events", params={"since": 0, "newest": "1", "limit": 1}).json()["last_seq"]
    traffic = Traffic(own, (info["pool_bytes"], info["budget_bytes"]))
    threads = [threading.Thread(target=traffic.requests, args=(i * 3,), daemon=True) for i in range(3)]
    threads.append(threading.Thread(target=traffic.settings, daemon=True))
    for t in threads:
        t.start()
    try:
        _until(lambda: traffic.count() >= 30, "no traffic")
        os.kill(own.rank_pid(1), signal.SIGKILL)
        _until(lambda: _restarted(own, last_seq), "rank 1 was not started again")
        at_restart = traffic.count()
        _until(lambda: traffic.count() >= max(TOTAL, at_restart + 30), f"only {traffic.count()} answers")
    finally:
        traffic.stop.set()
        for t in threads:
            t.join(180)
    assert not any(t.is_alive() for t in threads)
    answers = list(traffic.answers)
    wrong = [(a.what, a.status, a.retry_after, json.dumps(a.body)[:300], why) for a in answers if (why := _wrong(a))]
    assert not wrong, f"{len(wrong)} of {len(answers)} answers wrong, e.g. {wrong[:5]}"
    restarting = [a for a in answers if a.status == 503 and a.what != "GET /health"]
    assert restarting, "no request met the rank while it was down: the test did not test anything"
    assert any(a.what == "POST /settings" for a in restarting), "no settings change met the rank while it was down"
    assert not traffic.settings_seen, traffic.settings_seen
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=60) as http:
        _until(lambda: http.get(V1 + "/health").status_code == 200, "the engine did not turn healthy")
        budget, ranks = _budgets(http)
        assert ranks == [budget, budget], (budget, ranks)
        assert traffic.applied is None or budget == traffic.applied
        done = http.post(V1 + "/requests", json=PROMPT).json()
        assert done["hash_ok"] is True and done["external_tokens"] == 600


def _command_name(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _kill_rank1(own: Engine, *first: int) -> int:
    """SIGKILL the processes ``first``, then rank 1; wait until the engine has started rank 1 again as a new process
    and return its pid."""
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=60) as http:
        last_seq = http.get(V1 + "/events", params={"since": 0, "newest": "1", "limit": 1}).json()["last_seq"]
    old = own.rank_pid(1)
    for pid in (*first, old):
        os.kill(pid, signal.SIGKILL)
    _until(lambda: _restarted(own, last_seq) and own.rank_pid(1) != old, "rank 1 was not started again")
    return own.rank_pid(1)


def test_ranks_are_named_for_ps_and_top_a_restarted_one_too(own: Engine) -> None:
    names = {r: _command_name(own.rank_pid(r)) for r in (0, 1)}
    assert names == {0: "bsr-rank0", 1: "bsr-rank1"}, names
    # Negative control: the name is each rank's own doing; the process they fork from is plain python.
    fork_server = _parent(own.rank_pid(0))
    assert _command_name(fork_server).startswith("python"), _command_name(fork_server)
    assert _command_name(_kill_rank1(own)) == "bsr-rank1"


def test_a_rank_is_started_again_when_the_fork_server_is_gone_too(own: Engine) -> None:
    """Ranks fork from a fork server (engine/ranks.py); an operator killing stray python processes in an incident may
    kill it. The next rank to start then starts a new one: the engine still gets its rank back."""
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=60) as http:
        assert http.post(V1 + "/requests", json=PROMPT).json()["hash_ok"] is True  # stored, whatever ran before
    fork_server = _parent(own.rank_pid(1))
    assert _command_name(fork_server).startswith("python"), _command_name(fork_server)
    new = _kill_rank1(own, fork_server)
    assert _command_name(new) == "bsr-rank1" and _parent(new) != fork_server
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=60) as http:
        _until(lambda: http.get(V1 + "/health").status_code == 200, "the engine did not turn healthy")
        done = http.post(V1 + "/requests", json=PROMPT).json()
        assert done["hash_ok"] is True and done["external_tokens"] == 600


def test_a_change_a_rank_fails_leaves_every_rank_as_the_engine_says(own: Engine) -> None:
    """Rank 1 is frozen (SIGSTOP) right before a budget change: rank 0 takes it, rank 1 never answers within the
    stall time, so rank 0 is put back and the change is refused. Rank 1 takes the change late once it runs again,
    and is put back too: afterwards every rank's budget is /info's, which never changed."""
    with httpx.Client(base_url=own.url, headers=own.auth(), timeout=120) as http:
        _until(lambda: http.get(V1 + "/health").status_code == 200, "the engine is not healthy")
        info = http.get(V1 + "/info").json()
        before = info["budget_bytes"]
        other = info["pool_bytes"] if before != info["pool_bytes"] else info["rws_bytes"]
        pid = own.rank_pid(1)
        os.kill(pid, signal.SIGSTOP)
        try:
            r = http.post(V1 + "/settings", json={"budget_bytes": other})
        finally:
            os.kill(pid, signal.SIGCONT)
        assert r.status_code == 503, r.text
        err = r.json()
        assert err["error"] == "rank-unresponsive" and err["rank"] == 1, err
        assert f"rank 0 was put back to budget_bytes {before}" in err["message"], err
        assert http.get(V1 + "/info").json()["budget_bytes"] == before

        def in_step() -> bool:
            budget, ranks = _budgets(http)
            return budget == before and ranks == [before, before]

        _until(in_step, f"ranks out of step with /info: {_budgets(http)}", limit_s=120)
        _until(lambda: http.get(V1 + "/health").status_code == 200, "rank 1 stayed unhealthy")
