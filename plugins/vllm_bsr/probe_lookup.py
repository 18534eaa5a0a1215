"""bsr's probe-only external-token lookup for vLLM: worker-side servers and the scheduler-side client.

LMCache's vLLM integration counts external tokens with a lookup client in the scheduler that asks a lookup
server in every worker (ZMQ over an ipc socket); each server calls ``LMCacheEngine.lookup(pin=True)``, which
pins the prefix until the load (or a cleanup) unpins it, and counts only the prefix found in one backend
chain. bsr replaces the server side with a probe-only one:

* ``ProbeLookupServer`` (one per worker): for every chunk of the request, per tier, is this rank's object
  present? L1 ``LocalCPUBackend.contains(pin=False)``, disk ``LocalDiskBackend.contains(pin=False)`` (a write
  still in its put queue, ``exists_in_put_tasks``, is NOT counted: it is not readable yet), Mooncake
  ``batch_is_exist == 1`` only (a dead master answers -900, which LMCache's own ``contains`` counts as a hit).
  No pins, no LRU touch, no bytes moved. It answers the rank's committable prefix: the tokens of the leading
  chunks that some tier holds. Any other backend (P2P, GDS, ...) is not probed and so counts as holding nothing.
* ``ProbeLookupClient`` (the scheduler): LMCache's own ``LMCacheLookupClient`` (same hashing, same wire format,
  same per-request result cache) over a transport that asks every rank's bsr server with ONE deadline for all of
  them, and takes the minimum over ranks, i.e. the chunks every TP rank holds. An unreachable, slow or failing
  rank makes the answer 0 external tokens (fail-closed), and the request is asked again at the next step.

Transport: LMCache's own (``ZmqRouterServerTransport`` on the worker, ``ZmqReqRepClientTransport`` in the
scheduler, socket paths from ``get_zmq_rpc_path_lmcache`` so ``VLLM_RPC_BASE_PATH`` applies) because its classes
subclass cleanly: the server transport is used as is, and the client transport only needs ``send_and_recv_all``
overridden, since stock LMCache waits ``lookup_timeout_ms`` per rank in turn (N ranks can cost N timeouts) where
bsr wants one deadline for the whole fan-out. The sockets are bsr's own (engine id suffixed ``_bsrprobe``), so
LMCache's own lookup server keeps running untouched next to them.

LMCache has one KV layout per engine, so "every group" is the one group LMCache keeps. Blending (CacheBlend)
requests carry tokens rather than chunk hashes; the bsr server answers 0 for them.

Verified here (tests/plugins/test_vllm_lookup.py): real LMCache 0.5.6 engines, real Mooncake, two ranks, the
client and servers over real ZMQ ipc sockets, without vLLM; inside vLLM's scheduler and worker processes (vLLM's
CPU build): tests/vllm.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from lmcache_bsr import _lmcache as lm
from lmcache_bsr.events import emit

from bsr_cli.mooncake.health import health_url_for, master_healthy

log = logging.getLogger("vllm_bsr.probe")
_rpc = lm.lookup_rpc()
ENGINE_SUFFIX = "_bsrprobe"
DEFAULT_TIMEOUT_MS = 2000
EngineFn = Callable[[], Any]
_ZmqReqRepClientTransport: Any = _rpc["ZmqReqRepClientTransport"]
_LMCacheLookupClient: Any = _rpc["LMCacheLookupClient"]


def probe_socket_path(engine_id: str, rank: int, rpc_port: int | str = 0, base_url: str | None = None) -> str:
    """The ipc path of rank ``rank``'s bsr probe server (LMCache's path scheme, bsr's own engine id).

    Without vLLM importable LMCache ignores ``VLLM_RPC_BASE_PATH`` and uses /tmp/vllm_rpc; bsr honours the variable
    either way (and vLLM's own value is the same variable when vLLM is there)."""
    if base_url is None and os.environ.get("VLLM_RPC_BASE_PATH"):
        base_url = os.environ["VLLM_RPC_BASE_PATH"]
        os.makedirs(base_url, exist_ok=True)
    return str(_rpc["get_zmq_rpc_path_lmcache"](f"{engine_id}{ENGINE_SUFFIX}", "lookup", rpc_port, rank, base_url))


def mooncake_health_url(eng: Any) -> str | None:
    cfg = getattr(eng, "config", None)
    extra = dict(getattr(cfg, "extra_config", None) or {})
    meta = extra.get("mooncake_metadata_server")
    return health_url_for(str(meta)) if meta and getattr(cfg, "remote_url", None) else None


class RankProber:
    """Per-tier, per-chunk presence of one rank's objects in its LMCache engine's backends. Never pins.

    ``engine_fn`` returns the engine (or None while LMCache has none: then nothing is held)."""

    def __init__(self, engine_fn: EngineFn) -> None:
        self.engine_fn = engine_fn
        self._master: tuple[float, bool] = (0.0, True)

    def tiers(self) -> list[str]:
        """bsr's names of the tiers this engine is configured with (L1 only when LMCache keeps a hot cache)."""
        eng = self.engine_fn()
        cfg = getattr(eng, "config", None)
        out = []
        if getattr(cfg, "remote_url", None):
            out.append("mooncake")
        if getattr(cfg, "local_disk", None):
            out.append("fs")
        if getattr(cfg, "local_cpu", False):
            out.append("cpu")
        return out

    def master_ok(self, url: str) -> bool:
        at, ok = self._master
        if time.monotonic() - at > 1.0:
            ok = master_healthy(url, timeout=1.0)
            self._master = (time.monotonic(), ok)
        return ok

    def presence(self, keys: Sequence[Any]) -> tuple[dict[str, list[bool]], dict[str, str]]:
        eng = self.engine_fn()
        if eng is None:
            return {}, {"engine": "LMCache has no engine in this process (degraded or not initialised)"}
        out: dict[str, list[bool]] = {}
        errors: dict[str, str] = {}
        try:
            bk = lm.backends(eng)
        except Exception as e:  # noqa: BLE001 - before post_init there is no storage manager: nothing is held
            return {}, {"engine": f"{type(e).__name__}: {e}"}
        for name, backend in bk.items():
            try:
                if name == "LocalCPUBackend":
                    out["cpu"] = [bool(backend.contains(k, pin=False)) for k in keys]
                elif name == "LocalDiskBackend":
                    # contains(pin=False): indexed (readable) only; a queued write is not counted.
                    out["fs"] = lm.disk_contains(eng, keys)
                elif name == "RemoteBackend":
                    url = mooncake_health_url(eng)
                    if url and not self.master_ok(url):
                        # Asking a dead master costs seconds per call and answers -900: say so instead.
                        raise ConnectionError(f"Mooncake master unreachable ({url})")
                    out["mooncake"] = lm.remote_exists(eng, keys)
                else:
                    errors[name] = "not probed by bsr (counts as holding nothing)"
            except Exception as e:  # noqa: BLE001 - an unreachable tier holds nothing, and says why
                tier = {"LocalCPUBackend": "cpu", "LocalDiskBackend": "fs", "RemoteBackend": "mooncake"}[name]
                errors[tier] = f"{type(e).__name__}: {e}"
                out[tier] = [False] * len(keys)
        return out, errors

    def prefix_tokens(self, keys: Sequence[Any], offsets: Sequence[int]) -> int:
        """This rank's committable prefix: the tokens of the leading chunks that at least one tier holds."""
        held, _ = self.presence(keys)
        n = 0
        for c, off in enumerate(offsets):
            if not any(col[c] for col in held.values()):
                break
            n += int(off)
        return n


class ProbeLookupServer:
    """A worker's bsr probe server: answers LMCache's lookup wire format with the probe-only committable prefix.

    Request frames (LMCache's): ``[hashes, offsets, lookup_id, request_configs_json]``; reply: the token count
    as 4 big-endian bytes. Any failure answers 0 at once (the client then counts 0 without waiting out its
    deadline). ``close()`` stops the thread within ~``poll_ms`` and closes the socket."""

    def __init__(self, engine_fn: EngineFn, socket_path: str, *, poll_ms: int = 200, rank: int | None = None) -> None:
        self.prober = RankProber(engine_fn)
        self.rank = rank
        self.socket_path = socket_path
        self.transport = _rpc["ZmqRouterServerTransport"](socket_path, recv_timeout_ms=poll_ms)
        self._running = True
        self.served = 0
        self.thread = threading.Thread(target=self._loop, daemon=True, name="bsr-probe-lookup-server")
        self.thread.start()

    def answer(self, frames: list[Any]) -> int:
        if len(frames) != 4:  # blending requests carry tokens, not chunk hashes
            return 0
        hashes, offsets, _lookup_id, cfg = frames
        eng = self.prober.engine_fn()
        if eng is None or not hashes:
            return 0
        configs = json.loads(cfg) if cfg else None
        keys = [
            k
            for _, _, k in eng.token_database.process_tokens(
                hashes=list(hashes), offsets=list(offsets), request_configs=configs
            )
        ]
        return self.prober.prefix_tokens(keys, offsets[: len(keys)])

    def _loop(self) -> None:
        while self._running:
            try:
                got = self.transport.recv_request()
            except Exception as e:  # noqa: BLE001 - a closed socket ends the loop; anything else is logged
                if self._running:
                    log.warning("bsr probe server: receive failed: %s", e)
                    time.sleep(0.05)
                continue
            if got is None:
                continue
            identity, frames = got
            try:
                n = self.answer(frames)
            except Exception as e:  # noqa: BLE001 - fail closed: 0 external tokens
                log.warning("bsr probe server: probe failed, answering 0: %s", e)
                n = 0
            emit("bsr_probe", rank=self.rank, tokens=int(n))
            try:
                self.transport.send_response(identity, int(n).to_bytes(4, "big"))
                self.served += 1
            except Exception as e:  # noqa: BLE001 - the client times out and counts 0
                log.warning("bsr probe server: reply failed: %s", e)

    def close(self) -> None:
        self._running = False
        self.thread.join(timeout=5.0)
        self.transport.close()
        self.transport.ctx.term()
        with contextlib.suppress(OSError):  # ZMQ leaves the ipc socket file behind
            os.unlink(self.socket_path.removeprefix("ipc://"))


class _DeadlineTransport(_ZmqReqRepClientTransport):  # type: ignore[misc]
    """LMCache's REQ fan-out with one deadline for every rank together (stock: ``timeout_ms`` per rank in turn).
    Any rank missing at the deadline: recreate the sockets (a REQ socket that timed out is stuck) and return []."""

    def send_and_recv_all(self, msg: list[Any]) -> list[bytes]:
        deadline = time.monotonic() + self.timeout_ms / 1000.0
        encoded = [self.encoder.encode(m) for m in msg]
        results: list[bytes] = []
        try:
            for s in self.sockets:
                s.send_multipart(encoded, copy=False)
            for s in self.sockets:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not s.poll(left_ms, zmq.POLLIN):
                    raise zmq.Again()
                results.append(s.recv())
        except zmq.ZMQError as e:
            log.warning(
                "bsr probe lookup: not every rank answered within %d ms (%s): 0 external tokens", self.timeout_ms, e
            )
            self._recreate_all_sockets()
            return []
        return results

    def close(self) -> None:
        # Stock close() also terminates zmq.Context.instance(), which is shared with every other LMCache transport
        # in the process (term() blocks while any of their sockets is open): close only bsr's sockets.
        for s in self.sockets:
            s.close(linger=0)


class ProbeLookupClient(_LMCacheLookupClient):  # type: ignore[misc]
    """LMCache's scheduler-side lookup client, asking bsr's probe servers of ``ranks`` (min over ranks).

    ``lookup`` returns the tokens every rank holds, 0 when any rank fails to answer by the deadline (not cached:
    the next scheduling step asks again), and never raises."""

    def __init__(self, config: Any, metadata: Any, socket_paths: Sequence[str], timeout_ms: int = DEFAULT_TIMEOUT_MS):
        params = [_rpc["SocketParams"](socket_path=p, rank=r) for r, p in enumerate(socket_paths)]
        super().__init__(config, metadata, _DeadlineTransport(params, int(timeout_ms)))

    def lookup(self, token_ids: Any, lookup_id: str, request_configs: dict | None = None) -> int:
        try:
            n = super().lookup(token_ids, lookup_id, request_configs)
        except Exception as e:  # noqa: BLE001 - fail closed
            log.warning("bsr probe lookup of %s failed, 0 external tokens: %s", lookup_id, e)
            self.reqs_status.pop(lookup_id, None)
            return 0
        return int(n or 0)


__all__ = [
    "DEFAULT_TIMEOUT_MS",
    "ProbeLookupClient",
    "ProbeLookupServer",
    "RankProber",
    "mooncake_health_url",
    "probe_socket_path",
]
