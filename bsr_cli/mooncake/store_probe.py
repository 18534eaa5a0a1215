"""Reading a real LMCache deployment's Mooncake store for `bsr probe --store` (no engine): which of a prompt's keys
the master lists, their replicas and checksum sidecars, whether the processes holding them answer now, and (when
nothing matched) the master's whole key listing. What is made of those answers is bsr_cli.core.store_match's and
bsr_cli.core.store_diagnosis's.

Fast on purpose (a probe is typed during an incident): only the standard library and Mooncake's client are imported,
the store is asked once for every key (`batch_is_exist`) and once for every held key's replicas
(`batch_get_replica_desc`), and holders are checked in parallel with a bound on threads and time."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from bsr_cli.core.integrity import sidecar_key
from bsr_cli.core.store_diagnosis import diagnose
from bsr_cli.core.store_match import (
    Holders,
    ListedSegment,
    StoreQuery,
    StoreRead,
    checksummed,
    choose_start,
    detection_hashes,
    liveness,
    prompt_chains,
    prompt_keys,
    replica_holders,
    store_probe_result,
)
from bsr_cli.core.store_probe import Diagnosis, Liveness, NoDiagnosis, StoreProbe
from bsr_cli.errors import EngineUnreachable, ServiceError
from bsr_cli.mooncake import health

# Keys per batch_is_exist / batch_get_replica_desc call (one call up to this many: 1,048,576 tokens at world size 4).
BATCH_KEYS = 16384
# Holders checked at once (a metadata lookup and a TCP connect each), and the time all of them may take.
LIVENESS_THREADS = 8
LIVENESS_DEADLINE_S = 3.0

T = TypeVar("T")

# Keeps a native client open until the process ends instead of closing it (True), or declines (False: close it).
LeaveOpen = Callable[[object], bool]


def probe_store(
    query: StoreQuery,
    read_tokens: Callable[[], list[int]],
    *,
    timeout_s: float,
    verbose: bool,
    width: int | None,
    leave_open: LeaveOpen,
) -> StoreProbe:
    """Ask the store what it holds of the prompt ``read_tokens`` gives (read while the client connects; its error
    comes before the store's), each store call within ``timeout_s``, and check the holders: the store probe's result.
    Mooncake's own log stays off file descriptor 2 unless ``verbose``; ``leave_open`` may keep the client open (its
    close takes about a second) until the process ends."""
    if not verbose:
        os.environ.setdefault("GLOG_minloglevel", "3")  # Mooncake's glog: read when its library loads
    # Started first and waited for last: the master's segment listing and a check of every listed holder.
    holders = _background(lambda: _check_listed_holders(query.admin_url, query.metadata_url))
    with _native_stderr_silenced(not verbose):
        tokens, read = _read_store(query, read_tokens, timeout_s, leave_open)
    checked = holders()
    if isinstance(checked, BaseException):
        raise checked
    live = _liveness(checked, query.metadata_url, read, query.chunk_size)
    diagnosis = _diagnose_total_miss(query, read, tokens) if read.chunks and not read.held_keys else None
    return store_probe_result(query, tokens, read, live, diagnosis, width)


def _read_store(
    query: StoreQuery, read_tokens: Callable[[], list[int]], timeout_s: float, leave_open: LeaveOpen
) -> tuple[list[int], StoreRead]:
    """The prompt's tokens, and what the store holds of them: one session, every key asked in one batch."""
    # The client's set-up (~20 ms) runs while the prompt is read and hashed.
    connecting = _background(
        lambda: _StoreSession(query.rpc_address, query.metadata_url, timeout_s, query.store, leave_open)
    )
    try:
        tokens = read_tokens()
        detect = detection_hashes(query, tokens)
    except BaseException:
        session = connecting()
        if isinstance(session, _StoreSession):
            session.close()
        raise
    session = connecting()
    if isinstance(session, BaseException):
        raise session
    try:
        chosen, matched = _detect_start(session, query, detect)
        hashes, tail, rows = prompt_keys(query.key_format, tokens, query.chunk_size, dict(query.starts)[chosen])
        flat = [k for row in rows for k in row]
        held_flags = session.exists(flat)
        held_keys = [k for k, h in zip(flat, held_flags, strict=True) if h]
        replicas = session.replicas(held_keys) if held_keys else {}
        sidecars = session.sizes([sidecar_key(k) for k in held_keys]) if held_keys else {}
        sums = checksummed(held_keys, sidecars)
    finally:
        session.close()
    return tokens, StoreRead(chosen, matched, hashes, tail, rows, held_flags, held_keys, replicas, sums)


def _detect_start(
    session: _StoreSession, query: StoreQuery, detect: dict[str, list[int]]
) -> tuple[str, dict[str, int]]:
    """(the chain start's label, chunks held per candidate that held any). Under auto (``detect`` holds each
    candidate's first chunks), one probe of every candidate's keys; the most hits wins."""
    if not detect:
        return query.starts[0][0], {}
    batch = {label: query.key_format.keys_of(hs) for label, hs in detect.items()}
    held = session.exists([k for rows in batch.values() for row in rows for k in row])
    return choose_start(query.starts, batch, held)


def _diagnose_total_miss(query: StoreQuery, read: StoreRead, tokens: list[int]) -> Diagnosis | NoDiagnosis:
    """The master's key listing, diagnosed with this prompt's chunk hashes under every chain start bsr knows."""
    chains = prompt_chains(query, read, tokens)
    try:
        keys = health.all_keys(query.admin_url, timeout=10)
    except OSError as e:
        return NoDiagnosis(
            why=f"could not list the store's keys at {query.admin_url}: {e}",
            hint="pass --master-admin http://HOST:PORT (the master's metrics/admin port)",
        )
    return diagnose(
        keys, query.key_format, read.chosen, chains, auto=query.auto, tokens=tokens, chunk_size=query.chunk_size
    )


def _background(fn: Callable[[], T]) -> Callable[[], T | Exception]:
    """Run `fn` on a daemon thread now; the returned function waits for its value (or the exception it raised)."""
    box: list[T | Exception] = []

    def work() -> None:
        try:
            box.append(fn())
        except Exception as e:  # noqa: BLE001 - handed to the caller as a value
            box.append(e)

    t = threading.Thread(target=work, name="bsr-store-probe", daemon=True)
    t.start()

    def wait() -> T | Exception:
        t.join()
        return box[0]

    return wait


class _CallTimedOut(Exception):
    pass


class _StoreSession:
    """A read-only Mooncake client for one probe: no segment, no buffer, every call under a deadline (on a daemon
    thread, abandoned at the deadline). The master is probed over HTTP and TCP first: Mooncake's setup() against a
    dead master blocks ~90 s and leaves a client that crashes on use."""

    def __init__(
        self, rpc_address: str, metadata_url: str, deadline_s: float, store_url: str, leave_open: LeaveOpen
    ) -> None:
        self.store_url = store_url
        self.deadline_s = max(deadline_s, 0.1)
        self._leave_open = leave_open
        probe_s = min(2.0, self.deadline_s)
        down = None
        if metadata_url.startswith("http") and not health.master_healthy(health.health_url_for(metadata_url), probe_s):
            down = f"health probe {health.health_url_for(metadata_url)} failed"
        elif not health.tcp_reachable(rpc_address, timeout=probe_s):
            down = f"RPC port {rpc_address} refuses connections"
        if down:
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: mooncake master unavailable, not connecting: {down}",
                hint="check --store (RPC port) and --metadata",
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            hint = "apt-get install -y libibverbs1" if "libibverbs" in str(exc) else "pip install the Mooncake wheel"
            raise EngineUnreachable(f"cannot load the Mooncake client: {exc}", hint=hint) from None
        # Advertise this client's transfer endpoint on loopback (Mooncake otherwise picks the first NIC).
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        self._store = MooncakeDistributedStore()
        self._abandoned = False
        try:
            rc = self._call(lambda: self._store.setup("127.0.0.1", metadata_url, 0, 0, "tcp", "", rpc_address))
        except _CallTimedOut:
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: setup did not finish within {self.deadline_s:g} s",
                hint="check --store (RPC port) and --metadata",
            ) from None
        if rc != 0:
            self._abandoned = True  # a failed setup leaves nothing to close
            raise EngineUnreachable(
                f"cannot reach the Mooncake store at {store_url}: setup failed with code {rc}",
                hint="check --store (RPC port) and --metadata",
            )

    def _call(self, fn: Callable[[], T]) -> T:
        box: list[T | BaseException] = []
        done = threading.Event()

        def work() -> None:
            try:
                box.append(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box.append(e)
            done.set()

        threading.Thread(target=work, name="bsr-store-call", daemon=True).start()
        if not done.wait(self.deadline_s):
            self._abandoned = True  # closing under a running call can crash the process
            raise _CallTimedOut
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def exists(self, keys: list[str]) -> list[bool]:
        """One ``batch_is_exist`` (per BATCH_KEYS keys): 1 is held; 0 and errors are not."""
        out: list[bool] = []
        for i in range(0, len(keys), BATCH_KEYS):
            part = keys[i : i + BATCH_KEYS]
            try:
                rcs = self._call(lambda part=part: self._store.batch_is_exist(part))  # type: ignore[misc]
            except _CallTimedOut:
                raise EngineUnreachable(
                    f"the Mooncake store at {self.store_url} did not answer batch_is_exist in {self.deadline_s:g} s",
                    hint="is the master up? raise --timeout if the store is large or busy",
                ) from None
            if len(rcs) != len(part) or (part and all(rc < 0 for rc in rcs)):
                raise EngineUnreachable(
                    f"the Mooncake store at {self.store_url} failed batch_is_exist (codes {sorted(set(rcs))[:3]})",
                    hint="is the master up, and is this its RPC port? --verbose shows the Mooncake client's log",
                )
            out += [rc == 1 for rc in rcs]
        return out

    def _complete_replicas(self, keys: list[str]) -> dict[str, list[Any]]:
        """Each key's complete memory replicas' buffer descriptors, per the master. A key the master did not answer
        for is absent: what it holds is unknown."""
        out: dict[str, list[Any]] = {}
        for i in range(0, len(keys), BATCH_KEYS):
            part = keys[i : i + BATCH_KEYS]
            try:
                got = self._call(lambda part=part: self._store.batch_get_replica_desc(part))  # type: ignore[misc]
            except Exception:  # noqa: BLE001 - not answered (timed out, refused, an older client): unknown, never live
                continue
            for key, descs in got.items():
                complete = [
                    d.get_memory_descriptor().buffer_descriptor
                    for d in descs
                    if d.is_memory_replica() and str(d.status).endswith("COMPLETE")
                ]
                if complete:
                    out[key] = complete
        return out

    def replicas(self, keys: list[str]) -> dict[str, list[str]]:
        """The holders (transport endpoints) of each key's complete memory replicas; absent: liveness unknown."""
        return {k: [str(b.transport_endpoint) for b in bufs] for k, bufs in self._complete_replicas(keys).items()}

    def sizes(self, keys: list[str]) -> dict[str, int]:
        """Each held key's size in bytes (its first complete replica's); absent: not held, or unknown."""
        return {k: int(bufs[0].size) for k, bufs in self._complete_replicas(keys).items()}

    def close(self) -> None:
        """Close the client, or leave it open until the process ends where the caller can (closing joins
        Mooncake's threads: about 1 s)."""
        if self._abandoned or self._leave_open(self._store):
            return
        self._store.close()


@contextlib.contextmanager
def _native_stderr_silenced(enabled: bool) -> Iterator[None]:
    """Mooncake's C++ client logs (glog) straight to file descriptor 2; keep that off the terminal (--verbose
    shows it). Python's own error reporting happens after the block, on the restored descriptor."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(sink, 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
        finally:
            os.close(sink)
    finally:
        os.close(saved)


def check_holders(holders: Holders, metadata_url: str, names: Sequence[str]) -> None:
    """Ask each holder of ``names`` not checked yet whether it answers now (a metadata lookup and a TCP connect), at
    most LIVENESS_THREADS at once and all within LIVENESS_DEADLINE_S; one not checked in time stays unknown."""
    todo = holders.unchecked(names)
    if not todo:
        return
    pool = ThreadPoolExecutor(max_workers=min(LIVENESS_THREADS, len(todo)), thread_name_prefix="bsr-holder")
    futs = {n: pool.submit(health.check_holder, metadata_url, n, holders.te[n]) for n in todo}
    pool.shutdown(wait=False, cancel_futures=False)
    deadline = time.monotonic() + LIVENESS_DEADLINE_S
    for name, fut in futs.items():
        try:
            holders.endpoint[name], holders.alive[name] = fut.result(timeout=max(deadline - time.monotonic(), 0.0))
        except Exception:  # noqa: BLE001 - a holder that could not be checked is unknown, not dead or alive
            fut.cancel()


def _check_listed_holders(admin_url: str, metadata_url: str) -> Holders:
    """The master's segment listing (or why it could not be read), each listed holder checked."""
    try:
        listing = health.segments(admin_url, timeout=LIVENESS_DEADLINE_S)
    except ServiceError as e:
        return Holders((), e.message)
    found = Holders([ListedSegment(seg.segment_name, seg.te_endpoint, seg.size_bytes) for seg in listing], None)
    check_holders(found, metadata_url, list(found.te))
    return found


def _liveness(holders: Holders, metadata_url: str, read: StoreRead, chunk_size: int) -> Liveness:
    """Whether each listed chunk can really be read: the master names its replicas' holders (one batched replica
    query), and each holder not checked yet is asked directly (the master's listings keep a dead holder's entries
    until its client TTL runs out, ~10 s)."""
    check_holders(holders, metadata_url, replica_holders(read.replicas))
    return liveness(holders, read.rows, read.listed, read.replicas, chunk_size)


__all__ = ["BATCH_KEYS", "LIVENESS_DEADLINE_S", "LIVENESS_THREADS", "check_holders", "probe_store"]
