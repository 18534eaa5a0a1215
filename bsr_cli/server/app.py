"""The admin API's routes (``/bsr/v1/...`` and ``/metrics``) as a FastAPI app over one Coordinator.

Every route answers JSON (or NDJSON for a streamed restore or admission, or Prometheus text for /metrics); every
error is ``{"error": kind, "message": ..., "hint": ...}``: a body FastAPI finds invalid is a 400 ``invalid-input``
(never FastAPI's 422), a runtime error its mapped status, a handler bug a JSON 500. Routing, the token and the
body cap are checked before the body is read, by guard.Guard in front of this app; docs/admin-api.md lists the
routes, docs/openapi.json is generated from this app (``python -m bsr_cli.server.openapi``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import types
import typing
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Annotated, Any, Literal, Protocol, TypedDict

from fastapi import APIRouter, Depends, FastAPI, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from pydantic_core import ErrorDetails

from bsr_cli import API_VERSION
from bsr_cli.core import wire
from bsr_cli.core.events import Event
from bsr_cli.core.evidence import EventKind, Outcome
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.core.keys import synthetic_tokens
from bsr_cli.core.markers import ClearScope
from bsr_cli.core.registration import Registration
from bsr_cli.core.results import (
    AbortAnswer,
    Cleared,
    ErrorBody,
    ManualRestoreResult,
    Ok,
    ProbeResult,
    SubmitResult,
)
from bsr_cli.core.scrub import ScrubLimits, ScrubReport
from bsr_cli.core.status import (
    EngineInfo,
    EventPage,
    FaultListing,
    Health,
    MarkerList,
    PoolListing,
    Snapshot,
)
from bsr_cli.core.stream import AcceptedLine, ErrorLine, EventLine, ResultLine, StreamLine
from bsr_cli.errors import (
    AlreadyEnded,
    BadRequest,
    BsrError,
    CapacityError,
    FaultsDisabled,
    HostOverloaded,
    InvalidInput,
    RankRestarting,
    RestoreAborted,
)
from bsr_cli.runtime.coordinator import Coordinator, RankUnresponsive
from bsr_cli.runtime.event_store import Query as EventQuery
from bsr_cli.server import models as m
from bsr_cli.server.guard import Route, route
from bsr_cli.server.models import OpenAPIDocument

PREFIX = f"/bsr/{API_VERSION}"
NDJSON = "application/x-ndjson"
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Flag = Literal["0", "1"]
MAX_EVENTS_PAGE = 10_000  # events in one /events answer; a client pages on with ?since=
MAX_SEQ = 2**63 - 1  # the largest sequence number the event store can hold (SQLite INTEGER)


def status_for(e: BsrError) -> int:
    """The HTTP status of a runtime error: what the request met, never a 500 for a condition of the engine (a rank
    down or silent is 503, an aborted request 409); 500 only for an error that is a bug."""
    if isinstance(e, FaultsDisabled):
        return 403
    if isinstance(e, CapacityError | RestoreAborted | AlreadyEnded):
        return 409
    if isinstance(e, InvalidInput | BadRequest):
        return 400
    if isinstance(e, RankRestarting | RankUnresponsive):
        return 503
    if isinstance(e, HostOverloaded):
        return 503  # the host could not run the engine in time: retry later (no rank or tier is at fault)
    return 500


def _rank_of(e: BsrError) -> int | None:
    """The rank an error is about, when it names one (a rank restarting or not responding)."""
    return e.rank if isinstance(e, RankRestarting | RankUnresponsive) else None


def _retry_after(e: BsrError) -> int | None:
    """When to try again (whole seconds, at least 1): a rank restarting, or a refusal the same request may get past
    later (a capacity wait). A host overloaded gives none: the engine cannot tell when the host's load will drop,
    and a client retrying on a schedule would only add to it."""
    if isinstance(e, RankRestarting):
        return e.retry_after_s
    if isinstance(e, CapacityError) and e.retry_after_s is not None:
        return max(1, round(e.retry_after_s))
    return None


class NotFound(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


def _json(data: Any, status: int = 200) -> Response:
    body = json.dumps(data, default=str).encode()
    return Response(body, status_code=status, media_type="application/json", headers={"X-BSR-API": API_VERSION})


def _err(status: int, kind: str, message: str, hint: str | None = None) -> Response:
    return _json(ErrorBody(error=kind, message=message, hint=hint).to_wire(), status)


def _bsr_error(e: BsrError) -> Response:
    """A runtime error's answer: its status, kind, message and hint; the rank it names, and when to retry (also as
    Retry-After) for a rank restarting or a capacity refusal that may fit later."""
    retry = _retry_after(e)
    ended = e.outcome if isinstance(e, AlreadyEnded) else None
    body = ErrorBody(
        error=e.kind,
        message=e.message,
        hint=e.hint,
        rank=_rank_of(e),
        retry_after_s=retry,
        outcome=Outcome(ended) if ended is not None else None,
    )
    resp = _json(body.to_wire(), status_for(e))
    if retry is not None:
        resp.headers["Retry-After"] = str(retry)
    return resp


def _describe(err: ErrorDetails) -> str:
    """One line for pydantic's first complaint, naming the field as the request spelled it."""
    loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path")]
    where = ".".join(loc) or "body"
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind == "extra_forbidden":
        return f"unknown field(s): {where}"
    if kind == "too_short" and ctx.get("min_length") == 1:
        return f"'{where}' must not be empty"
    if kind == "less_than_equal":
        return f"'{where}' must be at most {ctx.get('le')}"
    if kind == "greater_than_equal":
        return f"'{where}' must be at least {ctx.get('ge')}"
    return f"'{where}': {str(err.get('msg', 'invalid')).removeprefix('Value error, ')}"


def tokens_of(body: m.PromptBody, max_tokens: int) -> list[int]:
    if (body.tokens is None) == (body.synthetic is None):
        raise InvalidInput(
            "give exactly one of 'tokens' or 'synthetic'", hint='send {"synthetic": {"n": N}} or {"tokens": [...]}'
        )
    if body.synthetic is not None:
        n = body.synthetic.n
        if n > max_tokens:
            raise BadRequest(
                f"prompt of {n:,} tokens exceeds this engine's limit of {max_tokens:,}",
                hint="send a shorter prompt, or start the engine with a larger --max-tokens",
            )
        return synthetic_tokens(n, body.synthetic.seed)
    toks = body.tokens or []
    if len(toks) > max_tokens:
        raise BadRequest(
            f"prompt of {len(toks):,} tokens exceeds this engine's limit of {max_tokens:,}",
            hint="send a shorter prompt, or start the engine with a larger --max-tokens",
        )
    return list(toks)


def _exclude(tiers: Sequence[str] | None, served: tuple[str, ...] | list[str]) -> list[str]:
    if tiers and set(tiers) - set(served):
        raise InvalidInput(
            f"exclude_tiers must be a list naming tiers of this engine: {list(served)}",
            hint="GET /info lists the engine's tiers",
        )
    return list(tiers or [])


# Statuses every operation can answer besides its own: 400 for a malformed body, query or head (a header given
# twice), 403 for a host name or web origin the engine does not serve, 411/413/415 for a chunked, oversized or
# non-JSON body, 431 for a head over 16 KiB, 503 when the serving slots are taken (busy), 500 for a handler bug
# (reported as JSON rather than dropped).
ERROR_TEXT = {
    400: "malformed body, query or head, or a value out of bounds",
    401: "missing or wrong bearer token (checked before the body is read)",
    403: "a host name or web origin this engine does not serve (or, arming a fault, fault injection is disabled)",
    404: "no such request",
    409: "the request does not fit this engine's capacity (capacity), or it was aborted (aborted); an abort that "
    "came after the restore committed or ended (already-ended, with its outcome)",
    411: "a chunked body (send Content-Length)",
    413: "a body over the cap that follows from the prompt limit",
    415: "a body that is not application/json",
    431: "a request head over 16 KiB",
    500: "a server bug, reported rather than dropped",
    503: "unavailable: a rank is restarting (rank-restarting, with Retry-After) or not responding (rank-unresponsive), "
    "the host is overloaded (host-overloaded), or every serving slot is in use (busy, Retry-After: 1)",
}
COMMON_ERRORS = (400, 403, 411, 413, 415, 431, 500, 503)


# What a route answers, by status: the result types it sends (the document gives their schemas: server/openapi.py).
Answers = dict[int, tuple[type, ...]]
_ANSWERS = "x-bsr-answers"  # carries a route's answers from `_op` into its AnsweredRoute, never into the document


class AnsweredRoute(APIRoute):
    """A route that knows the result types it answers (``answers``: by status), declared where the route is."""

    def __init__(
        self, path: str, endpoint: Callable[..., Any], *, openapi_extra: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        extra = dict(openapi_extra or {})
        self.answers: Answers = extra.pop(_ANSWERS, {})
        super().__init__(path, endpoint, openapi_extra=extra or None, **kw)


class RouteDoc(TypedDict):
    """What a route's decorator takes from `_op`: its documented responses, its status, and the extra that carries
    its answers (by status, to its AnsweredRoute) and its bearer scheme."""

    responses: dict[int | str, wire.JsonObject]
    status_code: int
    openapi_extra: dict[str, object]


def _op(
    answer: type | None,
    *errors: int,
    auth: bool = False,
    stream: bool = False,
    status: int = 200,
    unavailable: tuple[type, ...] = (ErrorBody,),
    text: str | None = None,
) -> RouteDoc:
    """A route's documentation: the result type it answers (with ``status``), its error statuses (each an
    ErrorBody; ``unavailable``: what its 503 may be), its token, and whether it streams NDJSON (``text``: it
    answers plain text, so described)."""
    statuses = sorted({*COMMON_ERRORS, *errors, *((401,) if auth else ())})
    responses: dict[int | str, wire.JsonObject] = {s: {"description": ERROR_TEXT[s]} for s in statuses}
    answers: Answers = {s: (ErrorBody,) for s in statuses} | {503: unavailable}
    if answer is not None:
        answers[status] = (answer,)
    if stream:
        responses[200] = {"content": {NDJSON: {}}}
    if text is not None:
        responses[200] = {"description": text, "content": {"text/plain": {}}}
    security: wire.JsonObject = {"security": [{"bearer": []}]} if auth else {}
    return {"responses": responses, "status_code": status, "openapi_extra": {_ANSWERS: answers, **security}}


class Host(Protocol):
    """What the routes need of the server they run in (``AdminServer``): its coordinator, the engine's own OpenAPI
    document, the shutdown hook and the metrics text."""

    coordinator: Coordinator
    on_shutdown: Callable[[], None] | None

    def openapi_document(self) -> OpenAPIDocument: ...

    def metrics_text(self) -> str: ...


async def _host(request: Request) -> Host:
    host: Host | None = request.app.state.host
    if host is None:
        raise RuntimeError("this app was built only to generate its document")
    return host


async def _coordinator(host: Annotated[Host, Depends(_host)]) -> Coordinator:
    return host.coordinator


# The routes' parameters for the server and its coordinator (FastAPI dependencies: no part of the document).
HostDep = Annotated[Host, Depends(_host)]
CoordinatorDep = Annotated[Coordinator, Depends(_coordinator)]


# -- errors ------------------------------------------------------------------------------------------------------
async def _invalid(_: Request, exc: RequestValidationError) -> Response:
    errs = exc.errors()
    return _err(400, "invalid-input", _describe(errs[0]) if errs else "invalid request")


async def _runtime_error(_: Request, exc: BsrError) -> Response:
    return _bsr_error(exc)


async def _not_found(_: Request, exc: NotFound) -> Response:
    return _err(404, exc.kind, exc.message)


async def _server_error(_: Request, exc: Exception) -> Response:
    return _err(500, "server-error", f"{type(exc).__name__}: {exc}")


def create_app(host: Host | None) -> FastAPI:
    """The app over ``host``'s coordinator (``None`` only to generate the document: every route then fails)."""
    app = FastAPI(
        title="bsr engine admin API",
        version=API_VERSION,
        description="Served by every host of the BSR runtime (the embedded engine, the LMCache plugin, a vLLM "
        "worker). Loopback by default, answering loopback host names only; every route but /health needs a bearer "
        "token (reads included), checked before the body is read; bodies are application/json. "
        "Every error is a JSON object (ErrorBody); a method a path does not serve gets 405 with an Allow header. "
        "Generated from bsr_cli/server/app.py.",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        # The router's own routes, not include_router (which newer FastAPI keeps as one entry that resolves its
        # routes lazily): the guard reads every APIRoute (routes_of).
        routes=router.routes,
        exception_handlers={
            RequestValidationError: _invalid,
            BsrError: _runtime_error,
            NotFound: _not_found,
            Exception: _server_error,
        },
    )
    app.state.host = host
    return app


# -- streaming ---------------------------------------------------------------------------------------------------
Emit = Callable[[Event], None]  # one progress event, streamed (in its wire form) as it happens
Work = Callable[[Emit], SubmitResult | ManualRestoreResult]


def _stream(c: Coordinator, request: str, work: Work) -> Response:
    """Run ``work`` in a thread, streaming its progress as NDJSON; a client that goes away aborts it."""

    async def lines() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamLine] = asyncio.Queue()

        def put(line: StreamLine) -> None:
            with contextlib.suppress(RuntimeError):  # the server stopped: nobody reads any more
                loop.call_soon_threadsafe(q.put_nowait, line)

        def run() -> None:
            try:
                result = work(lambda ev: put(EventLine(event=ev.to_wire())))
                put(ResultLine(result=result.to_wire()))
            except BsrError as e:
                put(
                    ErrorLine(
                        error=e.kind,
                        message=e.message,
                        hint=e.hint,
                        status=status_for(e),
                        rank=_rank_of(e),
                        retry_after_s=_retry_after(e),
                    )
                )
            except Exception as e:  # noqa: BLE001 - reported in the stream
                put(ErrorLine(error="server-error", message=f"{type(e).__name__}: {e}", says_hint=False))

        finished = False
        # Abortable before the worker thread is even scheduled: if this client goes away at once, the abort
        # below must find the request open, or the work would run to its end with nobody listening.
        c.open_request(request)
        threading.Thread(target=run, name=f"bsr-{request}", daemon=True).start()
        try:
            yield _line(AcceptedLine(request=request))
            while True:
                line = await q.get()
                yield _line(line)
                if isinstance(line, EventLine):
                    continue
                finished = True
                return
        finally:
            if not finished:
                # The operator went away mid-restore (Ctrl-C): end it fail-closed rather than leave it running
                # (unless it committed meanwhile: then its KV stays).
                with contextlib.suppress(AlreadyEnded):
                    c.abort(request)

    return StreamingResponse(lines(), media_type=NDJSON, headers={"X-BSR-API": API_VERSION})


class _OwnThread(Response):
    """An answer worked out on a thread of its own: a submit or restore may wait a long time for destination KV or
    room in B, and must not hold one of the worker threads that answer every other route meanwhile."""

    def __init__(self, work: Callable[[], Response]) -> None:
        super().__init__()
        self._work = work

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Response] = loop.create_future()

        def settle(outcome: Callable[[], Response]) -> None:
            try:
                answer, error = outcome(), None
            except BaseException as e:  # noqa: BLE001 - handed to the request's task, which raises it there
                answer, error = None, e
            with contextlib.suppress(RuntimeError):  # the server stopped: nobody waits for the answer any more
                loop.call_soon_threadsafe(_settle, done, answer, error)

        threading.Thread(target=settle, args=(self._work,), name="bsr-request", daemon=True).start()
        await (await done)(scope, receive, send)


def _settle(done: asyncio.Future[Response], answer: Response | None, error: BaseException | None) -> None:
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    elif answer is not None:
        done.set_result(answer)


# The routes whose work may wait for engine capacity (destination KV, room in B): each takes a place in the
# engine's request queue instead of a serving slot (guard.py), and its work runs on a thread of its own.
QUEUED_PATHS = frozenset({f"{PREFIX}/requests", f"{PREFIX}/restore"})

# -- routes (in the document's order) ----------------------------------------------------------------------------
router = APIRouter(route_class=AnsweredRoute)


@router.get(f"{PREFIX}/health", **_op(Health, unavailable=(Health, ErrorBody)))
def health(c: CoordinatorDep) -> Response:
    """Every rank healthy: 200; a rank down, silent or out of step: 503 with the same body (``ok`` false), and
    while a dead rank is being started again, Retry-After (seconds until its next try)."""
    h = replace(c.health(), api=API_VERSION)
    resp = _json(h.to_wire(), 200 if h.ok else 503)
    retry = c.restart_retry_after() if any(not r.alive for r in h.ranks) else None
    if retry is not None:
        resp.headers["Retry-After"] = str(retry)
    return resp


@router.get(f"{PREFIX}/openapi.json", **_op(OpenAPIDocument, auth=True))
def openapi_document(host: HostDep) -> Response:
    """This engine's OpenAPI document: the generic one with this engine's own bounds, so that a request valid
    against it is accepted (a 409 still says the capacity in use now does not fit it)."""
    return _json(host.openapi_document().to_wire())


@router.get(f"{PREFIX}/info", **_op(EngineInfo, auth=True))
def info(c: CoordinatorDep) -> Response:
    return _json(c.info().to_wire())


@router.get(f"{PREFIX}/registration", **_op(Registration, auth=True))
def registration(c: CoordinatorDep) -> Response:
    return _json(c.reg.to_dict())


@router.post(f"{PREFIX}/probe", **_op(ProbeResult, 409, auth=True))
def probe(body: m.ProbeBody, c: CoordinatorDep) -> Response:
    """Probe-only lookup: the complete hit bitmap (rank x group x chunk x tier), committable prefix, first
    break. Moves no object bytes; leaves nothing pinned."""
    tokens = tokens_of(body, c.settings.max_tokens)
    exclude = _exclude(body.exclude_tiers, c.settings.tiers)
    bitmap, errors = c.probe(tokens)
    result = ProbeResult(
        bitmap=bitmap,
        registration=c.reg,
        committable_chunks=bitmap.prefix_chunks(exclude),
        committable_tokens=bitmap.prefix_tokens(exclude),
        first_break=bitmap.first_break(exclude),
        tier_errors=errors,
        markers=tuple(c.list_markers()),
    )
    return _json(result.to_wire())


@router.post(f"{PREFIX}/requests", **_op(SubmitResult, 409, auth=True, stream=True))
def submit(body: m.SubmitBody, c: CoordinatorDep) -> Response:
    """Submit a prompt for admission as the scheduler would: restore the external prefix in windows
    (fail-closed, force-local marker, fallback to a lower tier or recompute), compute the rest, store it, hash
    it. JSON by default; with stream=true NDJSON progress: {type: accepted, request}, {type: event, event}...,
    then {type: result, result} or {type: error}."""
    tokens = tokens_of(body, c.settings.max_tokens)
    if body.stream:
        rid = c.new_request_id()
        return _stream(
            c,
            rid,
            lambda emit: c.submit(tokens, w=body.W, verify=body.verify, store=body.store, progress=emit, request=rid),
        )
    return _OwnThread(lambda: _json(c.submit(tokens, w=body.W, verify=body.verify, store=body.store).to_wire()))


@router.post(f"{PREFIX}/restore", **_op(ManualRestoreResult, 409, auth=True, stream=True))
def restore(body: m.RestoreBody, c: CoordinatorDep) -> Response:
    """A manual windowed restore of a prompt's external prefix (no fallback). NDJSON by default, JSON with
    stream=false. A client that disconnects aborts the restore (it ends fail-closed). As NDJSON: {type:
    accepted, request}, {type: event, event}..., then {type: result, result} or {type: error}."""
    tokens = tokens_of(body, c.settings.max_tokens)
    exclude = _exclude(body.exclude_tiers, c.settings.tiers)
    rid = c.new_request_id()

    def work(emit: Emit) -> ManualRestoreResult:
        return c.restore(tokens, w=body.W, verify=body.verify, exclude=exclude, progress=emit, request=rid)

    if body.stream:
        return _stream(c, rid, work)
    return _OwnThread(lambda: _json(work(lambda ev: None).to_wire()))


@router.post(f"{PREFIX}/restores/{{id}}/abort", **_op(AbortAnswer, 404, 409, auth=True))
def abort(id: Annotated[str, Path(min_length=1)], c: CoordinatorDep) -> Response:
    """Abort a running restore; it ends fail-closed. 409 already-ended when the abort lost the race (the restore
    committed first, or the request had ended: the answer names its outcome); 404 when no such request is known."""
    if not c.abort(id):
        raise NotFound("unknown-request", f"no request {id} is open on this engine")
    return _json(AbortAnswer(request=id, aborting=True).to_wire())


@router.get(f"{PREFIX}/pool", **_op(PoolListing, auth=True))
def pool(c: CoordinatorDep, health: Flag = "0") -> Response:
    """Live, peak, capacity, budget and windows in flight of every rank's restore pool (?health=1 adds tier
    health)."""
    return _json(PoolListing(tuple(r.with_draining() for r in c.pool(health=health == "1"))).to_wire())


@router.post(f"{PREFIX}/pool/reset-peak", **_op(Ok, auth=True))
def reset_peak(c: CoordinatorDep) -> Response:
    """Reset every rank's peak counter to its live bytes."""
    c.reset_peak()
    return _json(Ok().to_wire())


@router.post(f"{PREFIX}/settings", **_op(EngineInfo, auth=True))
def settings(body: m.SettingsBody, c: CoordinatorDep) -> Response:
    """Change the admission budget B, filesystem load concurrency or default W at run time (at least one). The
    resulting set is checked as `bsr engine up` checks it (one chunk slot <= B <= pool, RWS(W) <= pool, W <= the
    chunks of the longest prompt, fs_concurrency <= 256) and applied to every rank or to none: refused with 503
    rank-restarting while a rank is down (it starts again with the engine's settings); a rank that fails the
    change has the others put back. Answers the engine's info."""
    c.update_settings(budget_bytes=body.budget_bytes, fs_concurrency=body.fs_concurrency, w=body.W)
    return _json(c.info().to_wire())


@router.get(f"{PREFIX}/snapshot", **_op(Snapshot, auth=True))
def snapshot(
    c: CoordinatorDep,
    health: Flag = "1",
    events_since: Annotated[
        int | None,
        Query(ge=0, description="every event after this sequence number (up to 2,000) instead of the last 50"),
    ] = None,
) -> Response:
    """Everything a monitor draws at once: info, ranks and pools, active and recent restores, admission,
    tiers, markers, faults, recent events."""
    snap = c.snapshot(health=health == "1", events_since=events_since)
    return _json(replace(snap, ranks=tuple(r.with_draining() for r in snap.ranks)).to_wire())


@router.get(f"{PREFIX}/events", **_op(EventPage, auth=True))
def events(
    c: CoordinatorDep,
    since: Annotated[int, Query(ge=0, le=MAX_SEQ, description="only events after this sequence number (a cursor)")] = 0,
    before: Annotated[
        int | None,
        Query(ge=1, le=MAX_SEQ, description="only events before this sequence number (with newest=1: the older page)"),
    ] = None,
    wait: Annotated[
        float,
        Query(ge=0, allow_inf_nan=False, description="seconds to wait for a new event; more than 30 waits 30"),
    ] = 0.0,
    after: Annotated[
        float | None,
        Query(ge=0, allow_inf_nan=False, description="only events at or after this time (Unix seconds)"),
    ] = None,
    until: Annotated[
        float | None,
        Query(ge=0, allow_inf_nan=False, description="only events at or before this time (Unix seconds)"),
    ] = None,
    request: Annotated[
        str | None, Query(min_length=1, max_length=200, description="only this request's events")
    ] = None,
    prompt: Annotated[
        str | None, Query(min_length=1, max_length=200, description="only events naming this prompt hash")
    ] = None,
    kind: Annotated[list[EventKind] | None, Query(description="only events of these kinds (repeatable)")] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_EVENTS_PAGE, description="at most this many events")] = 500,
    newest: Annotated[Flag, Query(description="1: the last `limit` matches (still oldest first)")] = "0",
) -> Response:
    """The event log (the engine's durable store where it has one): every filter combines; oldest first. With
    only ?since=SEQ it long-polls up to ?wait=SECONDS (max 30) for the next event. Pages back from the newest with
    ?newest=1&limit=N, then ?newest=1&before=<the oldest seq of the last page>. Each answer says how many events
    the engine holds and the oldest one's seq."""
    log = c.events
    filtered = any(x is not None for x in (before, after, until, request, prompt, kind)) or newest == "1"
    if not filtered:
        evs = log.since(since, wait_s=min(wait, 30.0), limit=limit)
    else:
        q = EventQuery(
            after_seq=since,
            before_seq=before,
            since_time=after,
            until_time=until,
            request=request,
            prompt=prompt,
            kinds=tuple(kind or ()),
            limit=limit,
            newest=newest == "1",
        )
        evs = log.query(q)
    held, oldest = log.extent()
    page = EventPage(
        [e.to_wire() for e in evs], last_seq=log.last_seq, durable=log.durable, held=held, oldest_seq=oldest
    )
    return _json(page.to_wire())


@router.get(f"{PREFIX}/faults", **_op(FaultListing, auth=True))
def faults_list(c: CoordinatorDep) -> Response:
    """The armed faults."""
    return _json(FaultListing(enabled=c.settings.faults_enabled, faults=tuple(c.list_faults())).to_wire())


@router.post(f"{PREFIX}/faults", **_op(FaultSpec, 403, auth=True, status=201))
def faults_inject(body: m.FaultBody, c: CoordinatorDep) -> Response:
    """Arm a fault ({kind, rank?, window?, group?, count?}); 403 faults-disabled unless the engine allows
    faults. Answers 201 with the armed fault."""
    return _json(c.inject(FaultRequest(**body.model_dump(exclude_none=True))).to_wire(), 201)


@router.delete(f"{PREFIX}/faults", **_op(Cleared, auth=True))
def faults_clear(c: CoordinatorDep) -> Response:
    """Clear every armed fault."""
    return _json(Cleared(c.clear_faults()).to_wire())


@router.get(f"{PREFIX}/markers", **_op(MarkerList, auth=True))
def markers_list(c: CoordinatorDep) -> Response:
    """The force-local markers."""
    return _json(MarkerList(tuple(c.list_markers())).to_wire())


@router.delete(f"{PREFIX}/markers", **_op(Cleared, auth=True))
def markers_clear(c: CoordinatorDep) -> Response:
    """Clear every force-local marker; each is a marker_cleared event with scope "all"."""
    return _json(Cleared(c.clear_markers(ClearScope.all())).to_wire())


@router.delete(f"{PREFIX}/markers/prompts/{{prompt}}", **_op(Cleared, auth=True))
def markers_clear_prompt(prompt: Annotated[str, Path(min_length=1, max_length=256)], c: CoordinatorDep) -> Response:
    """Clear the marker of one prompt (its key as GET /markers lists it); cleared 0 when it has none."""
    return _json(Cleared(c.clear_markers(ClearScope.prompt(prompt))).to_wire())


@router.delete(f"{PREFIX}/markers/tiers/{{tier}}", **_op(Cleared, auth=True))
def markers_clear_tier(tier: m.Tier, c: CoordinatorDep) -> Response:
    """Take one tier out of every marker's exclusions (a marker left excluding nothing is removed): the
    remedy once that tier is fixed. Answers how many markers it touched."""
    return _json(Cleared(c.clear_markers(ClearScope.tier(tier))).to_wire())


@router.post(f"{PREFIX}/scrub", **_op(ScrubReport, auth=True))
def scrub(body: m.ScrubBody, c: CoordinatorDep) -> Response:
    """Read a tier's objects back whole and check them (header, key, length, payload checksum): one prompt's
    (tokens or synthetic) or every object (all), each rank its own, bounded by max_objects and max_bytes. Damaged
    objects are moved aside (the next store rewrites them). Answers when every rank is done."""
    if (body.tokens is not None) + (body.synthetic is not None) + body.all != 1:
        raise InvalidInput(
            "give exactly one of 'tokens', 'synthetic' or 'all'",
            hint="one prompt's objects ('tokens' or 'synthetic'), or every object of the tier ('all': true)",
        )
    tokens = None if body.all else tokens_of(body, c.settings.max_tokens)
    return _json(c.scrub(body.tier, tokens, ScrubLimits(body.max_objects, body.max_bytes)).to_wire())


@router.post(f"{PREFIX}/shutdown", **_op(Ok, auth=True))
def shutdown(host: HostDep) -> Response:
    """Stop the engine."""
    if host.on_shutdown:
        threading.Thread(target=host.on_shutdown, daemon=True).start()
    return _json(Ok().to_wire())


# The token is needed unless the engine serves /metrics openly (`bsr engine up --open-metrics`).
@router.get("/metrics", response_class=Response, **_op(None, auth=True, text="Prometheus text exposition format"))
def metrics(host: HostDep) -> Response:
    """Prometheus metrics: pool live/peak/capacity/budget per rank, rank up, restores by outcome, markers,
    faults (docs/monitoring.md)."""
    return Response(host.metrics_text(), media_type=METRICS_TYPE)


def _line(line: StreamLine) -> bytes:
    return (json.dumps(line.to_wire(), default=str) + "\n").encode()


def _takes_a_list(annotation: Any) -> bool:
    """Whether a query parameter's type is a list (optional or not): it may then be given more than once."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_takes_a_list(a) for a in typing.get_args(annotation))
    return origin in (list, tuple, set, frozenset)


def routes_of(app: FastAPI) -> list[Route]:
    """The guard's view of the app's routes: method, path, whether it needs the token and takes a JSON body."""
    out = []
    for r in app.routes:
        if isinstance(r, APIRoute):
            auth = bool((r.openapi_extra or {}).get("security"))
            query = [q.alias for q in r.dependant.query_params]
            lists = [q.alias for q in r.dependant.query_params if _takes_a_list(q.field_info.annotation)]
            for method in sorted(r.methods or ()):
                body = r.body_field is not None
                queued = r.path in QUEUED_PATHS
                out.append(
                    route(method, r.path, auth=auth, json_body=body, query=query, repeatable=lists, queued=queued)
                )
    return out
