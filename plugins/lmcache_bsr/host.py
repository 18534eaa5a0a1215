"""The BSR runtime hosted over real LMCache engines, with bsr's admin API in front.

``LMCacheHost`` builds one LMCacheRank per TP rank (threads in this process), bsr's Coordinator over them and
bsr's AdminServer (``/bsr/v1``): LMCache's own internal API server cannot host third-party routes, so each
process that hosts ranks serves bsr's server next to it, the way LMCache serves its internal API per worker.
``bsr probe/submit/restore/status/inject-fault`` then work against it unchanged.

Run one from a config file (YAML or JSON; see docs/deployment.md)::

    PYTHONPATH=plugins python -m lmcache_bsr.host host.yaml
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import secrets
import signal
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict, cast

from bsr_cli.core.bitmap import HitBitmap
from bsr_cli.core.events import Event
from bsr_cli.core.faults import FaultRequest, FaultSpec
from bsr_cli.core.keys import chunk_hashes
from bsr_cli.core.registration import KVGroup, Registration, TensorSpec
from bsr_cli.core.results import ManualRestoreResult, OutputHashes, StoreReport, SubmitResult, TierErrors
from bsr_cli.errors import InvalidInput
from bsr_cli.runtime.coordinator import Coordinator, EngineSettings, Progress
from bsr_cli.runtime.events import EventLog
from bsr_cli.server.admin import AdminServer

from .rank import LMCacheRank, ThreadRank
from .tokens import TokenRegistry

if TYPE_CHECKING:
    from ._lmcache import LMCacheConfig

UNSUPPORTED_FAULTS = {
    # LMCache's naive serde stores no checksum, so a flipped byte cannot be detected: refusing beats pretending.
    "corrupt": "objects stored by LMCache carry no checksum, so corruption cannot be detected over LMCache",
}


NOT_APPLICABLE = (
    "the restored KV was not computed by this host (real model data LMCache stored): bsr's canonical hash exists "
    "only for KV its own synthetic model computed, so there is nothing to compare against; kv_checksum is the "
    "SHA-256 of the installed bytes"
)


class LMCacheCoordinator(Coordinator):
    """bsr's Coordinator, plus what LMCache needs: tokens behind chunk hashes, honest faults, and an honest hash
    report (a canonical hash is compared only for chunks this host itself computed and stored)."""

    MAX_OWN_CHUNKS = 1 << 20

    def __init__(self, *a: Any, registry: TokenRegistry, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.registry = registry
        self._own: OrderedDict[str, None] = OrderedDict()  # chunk hashes whose KV this host computed and stored
        self._own_lock = threading.Lock()

    def _store_missing(
        self, bitmap: HitBitmap, hashes: list[str], n_tokens: int, tables: dict[str, list[int]]
    ) -> StoreReport:
        res = super()._store_missing(bitmap, hashes, n_tokens, tables)
        self.vouch_for(hashes[: n_tokens // self.reg.chunk_size])
        return res

    def vouch_for(self, hashes: Sequence[str]) -> None:
        """Record chunks whose stored KV is this host's synthetic model output, so restores of them are checked
        against the canonical hash: chunks this host stored itself, or (the peer benchmark) chunks another process
        of the same deployment computed with the same synthetic model and stored."""
        with self._own_lock:
            for h in hashes:
                self._own[h] = None
                self._own.move_to_end(h)
            while len(self._own) > self.MAX_OWN_CHUNKS:
                self._own.popitem(last=False)

    def _canonical_applies(self, tokens: Sequence[int], exclude: Sequence[str] = ()) -> bool:
        """Whether every chunk a restore of these tokens would load is KV this host computed (the only KV with a
        canonical hash). A probe-only lookup: nothing moves."""
        hashes = chunk_hashes(tokens, self.reg.chunk_size)
        bitmap, _ = self.probe(tokens, hashes)
        n = bitmap.prefix_chunks(set(exclude))
        with self._own_lock:
            return all(h in self._own for h in hashes[:n])

    def submit(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        store: bool = True,
        progress: Progress | None = None,
        request: str | None = None,
    ) -> SubmitResult:
        applies = not verify or self._canonical_applies(tokens)
        out = super().submit(tokens, w=w, verify=verify and applies, store=store, progress=progress, request=request)
        # The output hash of KV this host did not compute is only a checksum of the installed bytes.
        return out if applies else dataclasses.replace(out, canonical_hash=None, hash_ok=None, hash_note=NOT_APPLICABLE)

    def restore(
        self,
        tokens: Sequence[int],
        *,
        w: int | None = None,
        verify: bool = True,
        exclude: Sequence[str] = (),
        progress: Progress | None = None,
        request: str | None = None,
    ) -> ManualRestoreResult:
        applies = not verify or self._canonical_applies(tokens, exclude)
        out = super().restore(
            tokens, w=w, verify=verify and applies, exclude=exclude, progress=progress, request=request
        )
        if applies or out.hashes is None:
            return out
        return dataclasses.replace(out, hashes=OutputHashes(out.hashes.output_hash), hash_note=NOT_APPLICABLE)

    def probe(self, tokens: Sequence[int], hashes: list[str] | None = None) -> tuple[HitBitmap, TierErrors]:
        # Every admission path probes first with the tokens in hand: remember which tokens each hash stands for.
        self.check_tokens(tokens)
        hashes = hashes or chunk_hashes(tokens, self.reg.chunk_size)
        self.registry.register(tokens, hashes)
        return super().probe(tokens, hashes)

    def inject(self, request: FaultRequest) -> FaultSpec:
        kind = request.kind
        if kind in UNSUPPORTED_FAULTS:
            raise InvalidInput(f"fault kind {kind!r} is not supported by the LMCache host: {UNSUPPORTED_FAULTS[kind]}")
        return super().inject(request)


class ModelConfig(TypedDict):
    """The model a host serves, as its config names it: its KV layout (one group, one [2, kv_heads, head_size]
    tensor per layer)."""

    name: str
    layers: int
    kv_heads: int
    head_size: int
    dtype: NotRequired[str]  # bf16 unless given
    block_size: NotRequired[int]
    tp_size: NotRequired[int]
    chunk_size: NotRequired[int]


class AdminConfig(TypedDict, total=False):
    """Where the host's admin API serves (loopback and a free port unless given) and its token."""

    host: str
    port: int
    token: str


class HostConfig(TypedDict):
    """A host's config (docs/deployment.md): the model, LMCache's configuration of each rank's engine, bsr's engine
    settings and the admin API."""

    model: ModelConfig
    lmcache: LMCacheConfig
    settings: NotRequired[dict[str, Any]]  # EngineSettings' fields, as keyword arguments
    admin: NotRequired[AdminConfig]


def registration_from(cfg: HostConfig) -> Registration:
    m = cfg["model"]
    layers, heads, head_size = int(m["layers"]), int(m["kv_heads"]), int(m["head_size"])
    dtype = str(m.get("dtype", "bf16"))
    group = KVGroup("attn", int(m.get("block_size", 16)))
    tensors = tuple(TensorSpec(f"layers.{i}.kv", dtype, (2, heads, head_size), "attn") for i in range(layers))
    return Registration(
        model=str(m["name"]),
        tp_size=int(m.get("tp_size", 1)),
        groups=(group,),
        tensors=tensors,
        chunk_size=int(m.get("chunk_size", 256)),
        source="lmcache-host",
    )


class LMCacheHost:
    """Ranks + coordinator (+ admin server once ``serve`` is called). Always ``close()`` it (also at exit)."""

    def __init__(self, cfg: HostConfig) -> None:
        self.cfg = cfg
        self.reg = registration_from(cfg)
        s = dict(cfg.get("settings") or {})
        s.setdefault("name", "lmcache")
        s.setdefault("tokenizer", "bytes")
        if "tiers" in s:
            s["tiers"] = tuple(s["tiers"])
        self.settings = EngineSettings(**s)
        self.events = EventLog()
        self.registry = TokenRegistry(self.reg.chunk_size)
        self.ranks: list[ThreadRank[LMCacheRank]] = []
        self.admin: AdminServer | None = None
        holder: dict[str, Coordinator] = {}

        def emit(ev: Event) -> None:
            c = holder.get("c")
            if c is not None:
                c.on_rank_event(ev)

        try:
            for r in range(self.reg.tp_size):
                impl = LMCacheRank(
                    r,
                    self.reg,
                    cfg["lmcache"].copy(),
                    kv_tokens=self.settings.kv_tokens,
                    registry=self.registry,
                    emit=emit,
                    budget_bytes=self.settings.budget_bytes,
                )
                self.ranks.append(ThreadRank(impl))
        except BaseException:
            self.close()
            raise
        self.coordinator = LMCacheCoordinator(self.reg, self.ranks, self.settings, self.events, registry=self.registry)
        holder["c"] = self.coordinator
        if not self.settings.pool_bytes:
            self.settings.pool_bytes = self.ranks[0].impl.tracker.heap_bytes if self.ranks else 0
        atexit.register(self.close)  # destroy engines even if the caller forgets (else exit hangs)

    def rank(self, r: int) -> LMCacheRank:
        return self.ranks[r].impl

    def serve(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> AdminServer:
        self.admin = AdminServer(self.coordinator, token=token or secrets.token_urlsafe(24), host=host, port=port)
        self.admin.start()
        return self.admin

    def close(self) -> None:
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        ranks, self.ranks = self.ranks, []
        for r in ranks:
            r.close()


def load_config(path: str | Path) -> HostConfig:
    """The config file, taken as HostConfig documents it: LMCacheHost reads it key by key (a missing key or a value
    of the wrong kind fails there)."""
    text = Path(path).read_text()
    if str(path).endswith((".yaml", ".yml")):
        import yaml

        return cast(HostConfig, dict(yaml.safe_load(text)))
    return cast(HostConfig, dict(json.loads(text)))


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m lmcache_bsr.host CONFIG.(yaml|json)", file=sys.stderr)
        return 2
    cfg = load_config(argv[0])
    admin_cfg: AdminConfig = cfg.get("admin") or {}
    host = LMCacheHost(cfg)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    try:
        admin = host.serve(admin_cfg.get("host", "127.0.0.1"), int(admin_cfg.get("port", 0)), admin_cfg.get("token"))
        admin.on_shutdown = done.set
        print(f"bsr admin API (LMCache host, {len(host.ranks)} ranks) serving {admin.url}", flush=True)
        done.wait()
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
