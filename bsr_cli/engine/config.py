"""``engine.json``: everything the engine process (bsr_cli.engine.server) is built from, as `bsr engine up` writes
it into the state directory. The file keeps its layout (key order included: `bsr bundle` copies it as it is); these
types are how the supervisor writes it and the engine reads it back."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from bsr_cli.core import wire
from bsr_cli.core.registration import Registration
from bsr_cli.engine import netns
from bsr_cli.runtime.coordinator_state import EngineSettings
from bsr_cli.runtime.pool import PoolStats

# The resolved settings the engine process runs with (engine.json's "settings": the runtime's EngineSettings).
ENGINE_SETTINGS = (
    "w",
    "pool_bytes",
    "budget_bytes",
    "max_tokens",
    "kv_tokens",
    "faults_enabled",
    "fs_concurrency",
    "fetch_timeout_s",
    "kv_wait_s",
    "overload_ceiling_s",
    "scrub_after_failure",
)


@dataclass(frozen=True)
class MooncakeEndpoints:
    """Where the engine's Mooncake master answers (RPC, metadata, health, admin)."""

    master_address: str
    metadata_url: str
    health_url: str | None = None
    admin_url: str | None = None

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class StoreAddresses:
    """The store's service addresses on a multi-host engine's links (host:port)."""

    master: str  # the master's RPC address
    holder: str  # the segment holder's service address


@dataclass(frozen=True)
class StoreHosts:
    """A multi-host engine (`--hosts netns`): its namespaces and links, and the store's addresses on them."""

    topology: netns.Topology
    endpoints: StoreAddresses

    to_wire = wire.writer()
    from_wire = wire.reader()

    def endpoint(self, node: str) -> str:
        return self.endpoints.master if node == netns.MASTER else self.endpoints.holder


@dataclass(frozen=True)
class AdminConfig:
    """The admin server's self-defence (bsr_cli/server/admin.py; an absent limit keeps the server's default), the
    host names it answers to besides loopback and its bind address, and whether /metrics needs the token."""

    limits: dict[str, float] = field(default_factory=dict)
    allowed_hosts: tuple[str, ...] = ()
    open_metrics: bool = False

    def limit(self, name: str, default: float) -> float:
        return self.limits.get(name, default)


@dataclass(frozen=True)
class EventRetention:
    """How long the durable event store keeps events, and the size beyond which the oldest go."""

    max_age_s: float
    max_bytes: int

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineConfig:
    registration: Registration
    settings: EngineSettings
    mooncake: MooncakeEndpoints | None
    hosts: StoreHosts | None
    fs_dir: str
    host: str = "127.0.0.1"
    port: int = 0
    admin: AdminConfig = field(default_factory=AdminConfig)
    events: EventRetention | None = None

    # Not the codec's: "settings" is the part of EngineSettings the engine runs with, and the admin limits come
    # first in "admin", before its host names.
    def to_wire(self) -> wire.JsonObject:
        s = self.settings
        return {
            "registration": self.registration.to_dict(),
            "settings": {k: getattr(s, k) for k in ENGINE_SETTINGS} | {"tiers": list(s.tiers)},
            "mooncake": wire.value_to_wire(self.mooncake),
            "hosts": wire.value_to_wire(self.hosts),
            "fs_dir": self.fs_dir,
            "host": self.host,
            "port": self.port,
            "admin": self.admin.limits
            | {"allowed_hosts": list(self.admin.allowed_hosts), "open_metrics": self.admin.open_metrics},
            "events": wire.value_to_wire(self.events),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> EngineConfig:
        """engine.json as written by `bsr engine up`; what it leaves out takes the engine's defaults."""
        reg, mc, hosts, events = d["registration"], d.get("mooncake"), d.get("hosts"), d.get("events")
        return cls(
            registration=Registration.from_dict(reg if isinstance(reg, dict) else {}),
            settings=wire.read(EngineSettings, d["settings"]),
            mooncake=MooncakeEndpoints.from_wire(mc) if mc else None,
            hosts=StoreHosts.from_wire(hosts) if hosts else None,
            fs_dir=str(d["fs_dir"]),
            host=str(d.get("host", "127.0.0.1")),
            port=wire.value_from_wire(int, d.get("port", 0)),
            admin=_admin_from_wire(d.get("admin")),
            events=EventRetention.from_wire(events) if events else None,
        )


def _admin_from_wire(admin: wire.JsonValue) -> AdminConfig:
    """engine.json's "admin": the server's limits (numbers), then its host names and whether /metrics is open."""
    given = admin if isinstance(admin, dict) else {}
    allowed = given.get("allowed_hosts")
    limits = {str(k): v for k, v in given.items() if k not in ("allowed_hosts", "open_metrics")}
    return AdminConfig(
        {k: v for k, v in limits.items() if isinstance(v, int | float)},
        tuple(str(h) for h in allowed) if isinstance(allowed, list) else (),
        bool(given.get("open_metrics", False)),
    )


@dataclass(frozen=True)
class Restored:
    """What an engine brought back from the previous run (and dropped), with one line per fact."""

    markers: int = 0
    settings: dict[str, int] = field(default_factory=dict)
    dropped_faults: int = 0
    lines: tuple[str, ...] = ()

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class RankLink:
    """A link from a rank's host to the store's: checked when a fetch fails, so the failure names the link."""

    link: str
    peer: str
    address: str  # the peer's address, host:port


@dataclass(frozen=True)
class RankConfig:
    """What one rank process is started with (it crosses the pipe to the new process as it is)."""

    rank: int
    registration: Registration
    blocks: dict[str, int]  # destination KV blocks per layer group
    pool_bytes: int
    budget_bytes: int
    mooncake: MooncakeEndpoints | None
    fs_dir: str
    fs_concurrency: int = 1
    log_dir: str | None = None
    # A multi-host engine's rank: its network namespace, its address there and its links to the store.
    netns: str | None = None
    address: str | None = None
    links: tuple[RankLink, ...] = ()
    # After a tier failed a restore at fetch or verify, scrub the rest of the prompt's objects on it (background).
    scrub_after_failure: bool = True


@dataclass(frozen=True)
class RankInfo:
    """What a rank process says about itself once it has started."""

    rank: int
    pid: int
    device: str
    torch: str
    kv_bytes: int
    pool: PoolStats
    tiers: tuple[str, ...]

    to_wire = wire.writer()
    from_wire = wire.reader()


@dataclass(frozen=True)
class EngineReady:
    """ready.json: written by the engine once it serves, read by `bsr engine up` waiting for it."""

    url: str
    pid: int
    ranks: tuple[RankInfo, ...]
    started_at: float
    restored: Restored

    to_wire = wire.writer()
    from_wire = wire.reader()


__all__ = [
    "AdminConfig",
    "EngineConfig",
    "EngineReady",
    "EventRetention",
    "MooncakeEndpoints",
    "RankConfig",
    "RankInfo",
    "RankLink",
    "Restored",
    "StoreAddresses",
    "StoreHosts",
]
