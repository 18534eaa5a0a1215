"""AdminClient: typed access to an engine's ``/bsr/v1`` admin API over httpx.

Every failure is raised as one of bsr_cli.errors' EngineError subclasses:

    EngineUnreachable   connection refused, DNS failure, reset     (nothing listens there)
    EngineTimeout       no answer within the deadline
    Unauthorized        401 (missing or wrong token)
    VersionMismatch     the engine speaks another API version
    FaultsDisabled      403 on fault injection
    EngineBusy          503 busy (every serving slot in use), after reads were retried with backoff
    RankRestarting      503 rank-restarting (a rank died and the engine starts it again), after reads waited for it
    RestoreAborted      409 aborted (the request was aborted)
    HostOverloaded      503 host-overloaded (the host starved the engine past its overload ceiling; not retried)
    AlreadyEnded        409 already-ended (an abort that came after the restore committed or ended)
    BadRequest          other 4xx (the engine's message is kept)
    ServerError         5xx, or an answer that is not the API's JSON
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypedDict, TypeVar, Unpack
from urllib.parse import quote

import httpx

from bsr_cli import API_VERSION
from bsr_cli.client.local_engine import connection, read_token_file, serving
from bsr_cli.core import wire
from bsr_cli.core.events import Event, known_event
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.core.prompt import Prompt
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import AbortAnswer, ManualRestoreResult, ProbeResult, SubmitResult
from bsr_cli.core.scrub import ScrubLimits, ScrubReport
from bsr_cli.core.status import EngineInfo, EventPage, FaultListing, Health, MarkerView, PoolEntry, Snapshot, event_seq
from bsr_cli.core.stream import AcceptedLine, ErrorLine, EventLine, ResultLine, StreamedRequest, read_line
from bsr_cli.errors import (
    AlreadyEnded,
    BadRequest,
    BsrError,
    CapacityError,
    EngineBusy,
    EngineError,
    EngineTimeout,
    EngineUnreachable,
    FaultsDisabled,
    HostOverloaded,
    InvalidInput,
    RankRestarting,
    RestoreAborted,
    ServerError,
    Unauthorized,
    VersionMismatch,
)
from bsr_cli.settings import Settings

R = TypeVar("R", SubmitResult, ManualRestoreResult)  # the result a streamed route answers
OnEvent = Callable[[Event], None]  # a progress event, read from the wire form the engine streams

PAGE = 5000  # events asked for per /events page when filtering
MAX_PAGES = 1000  # a bound on paging through a store that keeps growing meanwhile
# How long a scrub's answer is waited for: the engine's own wait for its ranks (runtime/scrub.py), and a margin.
SCRUB_WAIT_S = 630.0


_KIND_TO_ERROR: dict[str, type[BsrError]] = {
    cls.kind: cls for cls in (EngineBusy, Unauthorized, VersionMismatch, FaultsDisabled, RestoreAborted, HostOverloaded)
}


# A read the engine answered "busy" (or dropped before answering, as it does to the oldest waiting connections
# when strangers hold many open) is retried after these pauses; a write is not (it may have been applied).
READ_RETRY_PAUSES_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
# A read that met a rank the engine is starting again is retried after the engine's Retry-After, for this long in
# all (the engine's longest pause between two starts of a rank); a write is not retried.
RESTART_WAIT_S = 30.0


def _restarting(status: int, body: Any, retry_after: str | None = None) -> RankRestarting | None:
    """The error a 503 ``rank-restarting`` answer (or a stream's error line) stands for; None for any other."""
    if status != 503 or not isinstance(body, dict) or body.get("error") != RankRestarting.kind:
        return None
    rank, retry = body.get("rank"), body.get("retry_after_s")
    if not isinstance(retry, int) and retry_after is not None and retry_after.isdigit():
        retry = int(retry_after)
    retry = retry if isinstance(retry, int) and not isinstance(retry, bool) and retry >= 1 else 1
    return RankRestarting(
        str(body.get("message") or "a rank is restarting"),
        hint=str(body.get("hint") or f"retry in {retry}s (`bsr engine status` shows the rank's restarts)"),
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        retry_after_s=retry,
    )


# Said of a busy engine whose answer gives no hint of its own (an older engine).
BUSY_HINT = "retry shortly; if it stays busy, `bsr engine status` and the engine's log say who holds it"


def resolve_engine(settings: Settings) -> tuple[str, str | None, str]:
    """(URL, token, how it was found): --engine/BSR_ENGINE/config (a URL or a profile), else the embedded engine
    recorded in the state directory."""
    token = settings.token
    engine = settings.engine
    if engine:
        if "," in engine:
            raise InvalidInput(
                f"--engine names several engines ({engine}); only `bsr status` and `bsr top` take a fleet",
                hint="name one engine for this command",
            )
        if engine in settings.profiles:
            prof = settings.profiles[engine]
            url = prof.url
            if not url and prof.urls:
                raise InvalidInput(
                    f"profile {engine!r} names several engines (urls); only `bsr status` and `bsr top` take a fleet",
                    hint="name one engine for this command",
                )
            if not url:
                raise InvalidInput(
                    f"profile {engine!r} has no url",
                    hint=f'add url = "http://HOST:PORT" to profile {engine!r} in {settings.config_path}',
                )
            if not token and prof.token_file is not None:
                token = read_token_file(prof.token_file)
            return url.rstrip("/"), token or prof.token, f"profile {engine}"
        if not engine.startswith(("http://", "https://")):
            raise InvalidInput(
                f"--engine {engine!r} is neither a URL nor a profile",
                hint=f"profiles in {settings.config_path}: {', '.join(settings.profiles) or 'none'}",
            )
        if not token:  # an embedded engine on this machine: its own token, from its state directory
            local = serving(engine)
            token = local.token if local is not None else None
        return engine.rstrip("/"), token, settings.sources.get("engine", "flag")
    found = connection(Path(settings.state_dir))
    if found is None:
        raise EngineUnreachable(
            f"no engine given and none running in {settings.state_dir}",
            hint="start one with `bsr engine up`, or pass --engine URL",
        )
    url, state_token = found
    return url, token or state_token or None, f"state dir {settings.state_dir}"


class EventFilters(TypedDict, total=False):
    """The filters of ``GET /events`` that the readers of every held event take (see `AdminClient.events`)."""

    after: float | None
    until: float | None
    request: str | None
    prompt: str | None
    kinds: Sequence[str] | None


class AdminClient:
    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        timeout_s: float = 30.0,
        stream_timeout_s: float | None = None,
        transport: httpx.BaseTransport | None = None,
        connections: int = 100,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s
        # Streams (restore, submit) send progress as it happens: with a deadline given by the user, a stream
        # silent that long is given up on; without one, a long call may stay silent up to its own timeout.
        self.stream_timeout_s = stream_timeout_s
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # ``connections``: requests in flight at once through this client (httpx's pool; one more waits for one).
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=min(connections, 20))
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=timeout_s, transport=transport, limits=limits
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminClient:
        url, token, _ = resolve_engine(settings)
        explicit = "timeout_s" in settings.sources
        return cls(url, token, timeout_s=settings.timeout_s, stream_timeout_s=settings.timeout_s if explicit else None)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------------------------
    def _path(self, path: str) -> str:
        return f"/bsr/{API_VERSION}{path}"

    def _raise_for(self, r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        try:
            body = r.json()
        except ValueError:
            body = {}
        kind = str(body.get("error", "")) if isinstance(body, dict) else ""
        message = (body.get("message") if isinstance(body, dict) else None) or f"HTTP {r.status_code}"
        hint = (body.get("hint") if isinstance(body, dict) else None) or _hint_for(r.status_code)
        restarting = _restarting(r.status_code, body, r.headers.get("retry-after"))
        if restarting is not None:
            raise restarting
        if kind == CapacityError.kind:
            raise CapacityError(message, hint=hint, retry_after_s=_retry_after(r))
        if kind == AlreadyEnded.kind:
            outcome = body.get("outcome") if isinstance(body, dict) else None
            raise AlreadyEnded(message, hint=hint, outcome=outcome if isinstance(outcome, str) else None)
        if kind == EngineBusy.kind:
            raise EngineBusy(f"the engine is busy: {message}", hint=hint or BUSY_HINT)
        if kind in _KIND_TO_ERROR:
            raise _KIND_TO_ERROR[kind](message, hint=hint)
        if r.status_code == 401:
            raise Unauthorized(message, hint=hint)
        if r.status_code == 404 and not kind:
            raise VersionMismatch(
                f"{self.url} does not serve the bsr {API_VERSION} admin API (HTTP 404)",
                hint="is this a bsr engine, and of a compatible version?",
            )
        if r.status_code >= 500:
            raise ServerError(f"engine error: {message}", hint=hint)
        raise BadRequest(message, hint=hint)

    def _call(
        self,
        method: str,
        path: str,
        body: wire.JsonObject | None = None,
        *,
        timeout: float | None = None,
        params: dict[str, str | int | float | list[str]] | None = None,
    ) -> Any:
        read = method == "GET" or path == "/probe"
        slow = (f"{method} {path} within the deadline", "raise --timeout for long operations")
        timeout = timeout if timeout is not None else self.timeout_s
        r = self._send(method, path, timeout, slow, RESTART_WAIT_S if read else None, body=body, params=params)
        self._raise_for(r)
        try:
            return r.json()
        except ValueError:
            raise ServerError(
                f"{self.url} answered {method} {path} with something that is not JSON",
                hint="is this a bsr engine? `bsr status --engine URL` checks it",
            ) from None

    def _send(
        self,
        method: str,
        path: str,
        timeout: float,
        slow: tuple[str, str],
        restart_wait_s: float | None,
        *,
        body: wire.JsonObject | None = None,
        params: dict[str, str | int | float | list[str]] | None = None,
    ) -> httpx.Response:
        """The engine's last answer, whatever its status. A read (``restart_wait_s`` not None; a write may have been
        applied, so it is sent once) answered busy or dropped is retried with backoff, one that met a restarting rank
        for up to ``restart_wait_s``. ``slow``: what EngineTimeout says was not answered, and its hint."""
        pauses = iter(READ_RETRY_PAUSES_S if restart_wait_s is not None else ())
        restart_deadline = time.monotonic() + (restart_wait_s or 0.0)
        while True:
            try:
                r = self._http.request(method, self._path(path), json=body, params=params, timeout=timeout)
            except httpx.TimeoutException:
                raise EngineTimeout(f"{self.url} did not answer {slow[0]}", hint=slow[1]) from None
            except (httpx.RemoteProtocolError, httpx.ReadError) as e:
                if _pause(pauses):
                    continue
                raise EngineUnreachable(
                    f"the engine at {self.url} dropped the connection: {_why(e)}",
                    hint="the engine may be restarting: `bsr engine status`, then retry",
                ) from None
            except httpx.TransportError as e:
                raise _cannot_reach(self.url, e) from None
            if _is_busy(r) and _pause(pauses):
                continue
            if _wait_for_restart(r, restart_deadline):
                continue
            return r

    def _stream(
        self,
        path: str,
        body: StreamedRequest,
        result: type[R],
        on_event: OnEvent | None,
        on_accepted: Callable[[str], None] | None,
        timeout: float,
    ) -> R:
        """POST ``body`` and follow its NDJSON stream: ``on_accepted`` gets the request id, ``on_event`` each
        progress event this bsr knows (read into its type; a newer engine's kind is passed over), and the result
        line is read into the route's ``result`` type."""
        try:
            with self._http.stream(
                "POST",
                self._path(path),
                json=body.to_wire(),
                timeout=httpx.Timeout(self.timeout_s, read=self.stream_timeout_s or timeout),
            ) as r:
                if r.status_code >= 400:
                    r.read()
                    self._raise_for(r)
                for text in _lines(r.iter_lines()):
                    line = read_line(json.loads(text))
                    if isinstance(line, AcceptedLine) and on_accepted:
                        on_accepted(line.request)
                    elif isinstance(line, EventLine) and on_event:
                        event = known_event(line.event)
                        if event is not None:
                            on_event(event)
                    elif isinstance(line, ResultLine):
                        return result.from_wire(line.result)
                    elif isinstance(line, ErrorLine):
                        raise _stream_error(line)
        except httpx.TimeoutException:
            raise EngineTimeout(
                f"{self.url} sent no progress for {path} within {self.stream_timeout_s or timeout:g}s",
                hint="raise --timeout for long operations",
            ) from None
        except httpx.TransportError as e:
            raise EngineUnreachable(
                f"lost the engine at {self.url}: {_why(e)}",
                hint="the engine may have stopped: `bsr engine status`; a restore cut off so ends fail-closed",
            ) from None
        raise ServerError(
            f"the engine closed {path} without a result",
            hint="the engine's log says why; a restore cut off so ends fail-closed",
        )

    # -- API ---------------------------------------------------------------------------------------------------
    def health(self) -> Health:
        slow = ("/health", "the engine may be overloaded or stuck: `bsr engine status`; raise --timeout to wait longer")
        r = self._send("GET", "/health", min(self.timeout_s, 5.0), slow, restart_wait_s=0.0)
        # A 503 carries the health (a rank is unhealthy); busy, once the retries are spent, is an error.
        if r.status_code not in (200, 503) or _is_busy(r):
            self._raise_for(r)
        return Health.from_wire(r.json())

    def info(self) -> EngineInfo:
        info = self._call("GET", "/info")
        if info.get("api") != API_VERSION:
            raise VersionMismatch(
                f"engine speaks admin API {info.get('api')!r}, bsr speaks {API_VERSION!r}",
                hint="use the bsr version the engine runs (`bsr status` shows it)",
            )
        return EngineInfo.from_wire(info)

    def registration(self) -> Registration:
        return Registration.from_dict(self._call("GET", "/registration"), source="engine")

    def probe(self, prompt: Prompt, exclude_tiers: list[str] | None = None) -> ProbeResult:
        body = prompt.to_wire() | ({"exclude_tiers": exclude_tiers} if exclude_tiers else {})
        return ProbeResult.from_wire(self._call("POST", "/probe", body))

    def scrub(self, tier: str, prompt: Prompt | None, limits: ScrubLimits | None = None) -> ScrubReport:
        """Scrub ``tier``: the prompt's objects, or (``prompt`` None) every object it holds. Answers when every rank
        is done; a scrub is bounded by its limits, so its answer may take long: waits up to the engine's own
        deadline for the ranks (or ``--timeout`` when one is given)."""
        lim = limits or ScrubLimits()
        body: wire.JsonObject = {"tier": tier, "max_objects": lim.max_objects, "max_bytes": lim.max_bytes}
        body |= prompt.to_wire() if prompt is not None else {"all": True}
        timeout = self.stream_timeout_s or SCRUB_WAIT_S
        return ScrubReport.from_wire(self._call("POST", "/scrub", body, timeout=timeout))

    def submit(
        self,
        prompt: Prompt,
        *,
        w: int | None = None,
        verify: bool = True,
        on_event: OnEvent | None = None,
        timeout: float = 1800,
    ) -> SubmitResult:
        body = StreamedRequest(prompt=prompt, verify=verify, w=w)
        return self._stream("/requests", body, SubmitResult, on_event, None, timeout)

    def restore(
        self,
        prompt: Prompt,
        *,
        w: int | None = None,
        verify: bool = True,
        exclude_tiers: list[str] | None = None,
        on_event: OnEvent | None = None,
        on_accepted: Callable[[str], None] | None = None,
        timeout: float = 1800,
    ) -> ManualRestoreResult:
        body = StreamedRequest(prompt=prompt, verify=verify, w=w, exclude_tiers=tuple(exclude_tiers or ()))
        return self._stream("/restore", body, ManualRestoreResult, on_event, on_accepted, timeout)

    def abort(self, request: str) -> AbortAnswer:
        """Ask the engine to abort ``request``: aborting False when it knows no such request; raises AlreadyEnded
        when the abort came too late (the restore committed, or the request ended)."""
        try:
            return AbortAnswer.from_wire(self._call("POST", f"/restores/{request}/abort", {}, timeout=5.0))
        except BadRequest:
            return AbortAnswer(request=request, aborting=False)

    def pool(self, health: bool = False) -> list[PoolEntry]:
        ranks = self._call("GET", "/pool", params={"health": "1" if health else "0"})["ranks"]
        return [PoolEntry.from_wire(r) for r in ranks]

    def reset_peak(self) -> None:
        self._call("POST", "/pool/reset-peak", {})

    def update_settings(self, **changes: Any) -> EngineInfo:
        """Change B, the filesystem load concurrency or the default W; the engine's info with the new settings."""
        return EngineInfo.from_wire(self._call("POST", "/settings", changes))

    def snapshot(
        self, *, health: bool = True, timeout: float | None = None, events_since: int | None = None
    ) -> Snapshot:
        params: dict[str, str | int | float | list[str]] = {"health": "1" if health else "0"}
        if events_since is not None:
            params["events_since"] = events_since
        return Snapshot.from_wire(self._call("GET", "/snapshot", params=params, timeout=timeout))

    def events(
        self,
        since: int = 0,
        wait_s: float = 0.0,
        *,
        after: float | None = None,
        until: float | None = None,
        request: str | None = None,
        prompt: str | None = None,
        kinds: Sequence[str] | None = None,
        limit: int | None = None,
        newest: bool = False,
        before: int | None = None,
    ) -> EventPage:
        """One page of ``GET /events``: events after the cursor ``since`` (and before ``before``), filtered (every
        filter combines: ``after``/``until`` are Unix times, ``kinds`` any of), oldest first; ``newest`` asks for
        the last ``limit`` matches instead of the first."""
        params: dict[str, str | int | float | list[str]] = {"since": since, "wait": wait_s}
        filters = (("before", before), ("after", after), ("until", until), ("request", request), ("prompt", prompt))
        for key, value in filters:
            if value is not None:
                params[key] = value
        if kinds:
            params["kind"] = list(kinds)
        if limit is not None:
            params["limit"] = limit
        if newest:
            params["newest"] = "1"
        return EventPage.from_wire(self._call("GET", "/events", params=params, timeout=wait_s + 10))

    def held_events(self, since: int = 0, **filters: Unpack[EventFilters]) -> tuple[list[Event], int]:
        """`held_wire` read as types. An event of a kind this bsr does not know (a newer engine's) is left out
        rather than misread: what exports events (`bsr bundle`, `bsr events --json`) writes `held_wire` instead."""
        wire, last = self.held_wire(since, **filters)
        return [e for w in wire if (e := known_event(w)) is not None], last

    def held_wire(self, since: int = 0, **filters: Unpack[EventFilters]) -> tuple[list[dict[str, Any]], int]:
        """Every event the engine still holds after ``since`` that matches the filters, oldest first, as the
        engine sent them, and its last sequence number. One `/events` answer is a page starting from the oldest, so
        this pages on until it has the newest."""
        filtered = any(v is not None for k, v in filters.items() if k != "kinds") or bool(filters.get("kinds"))
        out: list[dict[str, Any]] = []
        seq = since
        last = 0
        for _ in range(MAX_PAGES):
            got = self.events(since=seq, **filters, limit=PAGE) if filtered else self.events(since=seq)
            page = [e for e in got.events if e]  # an item that was not an object reads as empty
            last = got.last_seq
            out.extend(page)
            if not page or event_seq(page[-1], last) >= last or (filtered and len(page) < PAGE):
                return out, last
            seq = event_seq(page[-1])
        return out, last

    def faults(self) -> FaultListing:
        return FaultListing.from_wire(self._call("GET", "/faults"))

    def inject_fault(self, fault: FaultRequest) -> FaultSpec:
        """Arm ``fault``; the fault as the engine armed it (its id, its expiry)."""
        return FaultSpec.from_wire(self._call("POST", "/faults", fault.to_wire()))

    def clear_faults(self) -> int:
        return int(self._call("DELETE", "/faults")["cleared"])

    def markers(self) -> list[MarkerView]:
        return [MarkerView.from_wire(m) for m in self._call("GET", "/markers")["markers"]]

    def clear_markers(self, *, prompt: str | None = None, tier: str | None = None) -> int:
        """Clear every marker, or only ``prompt``'s, or take ``tier`` out of every marker; how many it touched."""
        if prompt is not None and tier is not None:
            raise InvalidInput(
                "clear the markers of a prompt or of a tier, not both at once",
                hint="clear one at a time: --prompt KEY, then --tier T",
            )
        if prompt is not None:
            path = f"/markers/prompts/{quote(prompt, safe='')}"
        elif tier is not None:
            path = f"/markers/tiers/{quote(tier, safe='')}"
        else:
            path = "/markers"
        return int(self._call("DELETE", path)["cleared"])

    def metrics(self) -> str:
        try:
            r = self._http.get("/metrics")
        except httpx.TransportError as e:
            raise _cannot_reach(self.url, e) from None
        self._raise_for(r)
        return r.text


def _is_busy(r: httpx.Response) -> bool:
    if r.status_code != 503:
        return False
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("error") == "busy"


def _wait_for_restart(r: httpx.Response, deadline: float) -> bool:
    """For a read answered 503 ``rank-restarting``: sleep the engine's Retry-After if that ends before
    ``deadline``; False (do not retry) for any other answer or once the deadline would pass."""
    if r.status_code != 503:
        return False
    try:
        restarting = _restarting(r.status_code, r.json(), r.headers.get("retry-after"))
    except ValueError:
        return False
    if restarting is None or restarting.retry_after_s is None:
        return False
    pause = float(restarting.retry_after_s)
    if time.monotonic() + pause > deadline:
        return False
    time.sleep(pause)
    return True


def _pause(pauses: Iterator[float]) -> bool:
    """Sleep for the next backoff pause; False once they are used up."""
    pause = next(pauses, None)
    if pause is None:
        return False
    time.sleep(pause)
    return True


def _hint_for(status: int) -> str:
    """What to do about an error answer that came without a hint (an older engine's, or another host's)."""
    if status in (401, 403):
        return "give the engine's token: --token or BSR_TOKEN (`bsr engine up` keeps it in its state directory)"
    if status == 404:
        return "the engine knows no such object; `bsr events` lists recent requests"
    if status >= 500:
        return "the engine's log says why (`bsr engine status` names the state directory)"
    return "the engine refused the request as sent; `bsr status` shows what it serves"


def _retry_after(r: httpx.Response) -> float | None:
    """The seconds a refusal's Retry-After says to wait (None when it says none, or not in seconds)."""
    text = r.headers.get("retry-after", "").strip()
    return float(text) if text.isdigit() else None


def _stream_error(line: ErrorLine) -> BsrError:
    """The error a streamed answer's error line stands for."""
    restarting = _restarting(line.status, line.to_wire())
    if restarting is not None:
        return restarting
    hint = line.hint or _hint_for(line.status)
    if line.error == CapacityError.kind:
        return CapacityError(line.message, hint=hint, retry_after_s=line.retry_after_s)
    err = _KIND_TO_ERROR.get(line.error)
    if err:
        return err(line.message, hint=hint)
    cls: type[EngineError] = ServerError if line.status >= 500 else BadRequest
    return cls(line.message, hint=hint)


def _lines(it: Iterator[str]) -> Iterator[str]:
    for line in it:
        if line.strip():
            yield line


def _cannot_reach(url: str, e: httpx.TransportError) -> EngineUnreachable:
    return EngineUnreachable(f"cannot reach the engine at {url}: {_why(e)}", hint="is it running? `bsr engine status`")


def _why(e: Exception) -> str:
    text = str(e) or type(e).__name__
    return text.split("] ")[-1] if "] " in text else text
