"""Several hosts on one machine: the embedded engine's Mooncake master, segment holder and each TP rank in their own
Linux network namespace, joined by point-to-point veth links (`bsr engine up --hosts netns`).

Topology: every node (``master``, ``holder``, ``rank0``, ``rank1``, ...) has one address on its own loopback
(10.213.0.1 the master, .2 the holder, .10+i rank i) and a veth link to every other node it talks to: each rank to
the master and to the holder, and the holder to the master. A /32 route per peer sends traffic over the link to
that peer only, so cutting ``rank0↔holder`` (`ip link set DEV down`) leaves rank 0's path to the master and rank
1's path to the holder intact. The addresses exist only inside these namespaces (each engine's namespaces are
separate, so two engines can use the same ones); the admin API and the engine's coordinator stay in the host's
namespace and on its loopback. A bandwidth cap (``tc tbf``) can be put on both ends of every link.

Names carry a per-engine prefix (from the state directory), so `bsr engine down`, a test's teardown and the next
`up` after a crash remove every namespace and veth of that engine (deleting a namespace deletes its veths and their
qdiscs) and nothing of anyone else's. Needs root and iproute2 (`ip`, `tc`). Standard library only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TypeVar

from bsr_cli.core import wire
from bsr_cli.errors import ServiceError

T = TypeVar("T")

MODE = "netns"
MASTER, HOLDER = "master", "holder"
_ADDRESSES = {MASTER: "10.213.0.1", HOLDER: "10.213.0.2"}
_RANK_BASE = 10  # rank i is 10.213.0.(10+i)
_CLONE_NEWNET = 0x40000000
_NETNS_DIR = "/var/run/netns"
_IP_TIMEOUT_S = 20.0


def rank_node(rank: int) -> str:
    return f"rank{rank}"


def _short(node: str) -> str:
    """A node's short name in interface names (15 characters at most on Linux): m, h, r0, r1, ..."""
    return node[0] if node in (MASTER, HOLDER) else "r" + node.removeprefix("rank")


def prefix_for(state_dir: str | os.PathLike[str]) -> str:
    """The per-engine prefix of every namespace and interface name: ``bsr`` and 5 hex digits of the state dir."""
    digest = hashlib.sha256(os.path.abspath(os.fspath(state_dir)).encode()).hexdigest()[:5]
    return f"bsr{digest}-"


def unavailable() -> str | None:
    """Why namespaces cannot be used here (one line), or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if probe.returncode != 0:
        return f"`ip netns` is unavailable: {probe.stderr.strip() or probe.returncode}"
    return None


@dataclass(frozen=True)
class Link:
    """A veth pair between nodes ``a`` and ``b``: ``dev_a`` lives in a's namespace, ``dev_b`` in b's."""

    a: str
    b: str
    dev_a: str
    dev_b: str

    @property
    def name(self) -> str:
        return f"{self.a}↔{self.b}"

    def joins(self, x: str, y: str) -> bool:
        return {self.a, self.b} == {x, y}

    def to_wire(self) -> list[str]:
        """A link travels as its row: [a, b, dev_a, dev_b]."""
        return [self.a, self.b, self.dev_a, self.dev_b]


@dataclass(frozen=True)
class Topology:
    """One engine's namespaces and links; plain data (``to_wire``/``from_wire``) so it lives in engine.json."""

    prefix: str
    nodes: tuple[str, ...]
    links: tuple[Link, ...]
    rate_bps: int | None = None

    @classmethod
    def plan(cls, prefix: str, ranks: int, rate_bps: int | None = None) -> Topology:
        nodes = (MASTER, HOLDER, *(rank_node(r) for r in range(ranks)))
        pairs = [(HOLDER, MASTER)] + [(rank_node(r), peer) for r in range(ranks) for peer in (MASTER, HOLDER)]
        links = tuple(
            Link(a, b, f"{prefix}{_short(a)}{_short(b)}", f"{prefix}{_short(b)}{_short(a)}") for a, b in pairs
        )
        return cls(prefix, nodes, links, rate_bps)

    def netns(self, node: str) -> str:
        return f"{self.prefix}{node}"

    @staticmethod
    def address(node: str) -> str:
        if node in _ADDRESSES:
            return _ADDRESSES[node]
        return f"10.213.0.{_RANK_BASE + int(node.removeprefix('rank'))}"

    def link(self, x: str, y: str) -> Link:
        for link in self.links:
            if link.joins(x, y):
                return link
        raise KeyError(f"no link between {x} and {y}")

    to_wire = wire.writer()

    @classmethod
    def from_wire(cls, d: Mapping[str, wire.JsonValue]) -> Topology:
        """Not the codec's alone: each link is read from its row (a list, which the codec reads only as objects)."""
        rows = d.get("links")
        links = (
            tuple(Link(*(str(x) for x in row)) for row in rows if isinstance(row, list))
            if isinstance(rows, list)
            else ()
        )
        return replace(wire.read(cls, d), links=links)


# -- ip / tc -------------------------------------------------------------------------------------------------------


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and done.returncode != 0:
        raise ServiceError(
            f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}",
            hint="--hosts netns needs root (or CAP_NET_ADMIN) and iproute2",
        )
    return done


def _routes(topo: Topology, link: Link) -> None:
    """The /32 route to the peer over this link, on both ends (`replace`: a link taken down loses the route on the
    side that was set down, and bringing it up does not bring the route back)."""
    for node, dev, peer in ((link.a, link.dev_a, link.b), (link.b, link.dev_b, link.a)):
        _ip(
            "ip", "-n", topo.netns(node), "route", "replace", f"{topo.address(peer)}/32", "dev", dev,
            "src", topo.address(node),
        )  # fmt: skip


def _shape(topo: Topology, link: Link) -> None:
    if topo.rate_bps is None:
        return
    burst = max(topo.rate_bps // 8 // 50, 32 * 1024)  # 20 ms of traffic, and never under a few MTUs
    for node, dev in ((link.a, link.dev_a), (link.b, link.dev_b)):
        _ip(
            "tc", "-n", topo.netns(node), "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{topo.rate_bps}bit", "burst", str(burst), "latency", "200ms",
        )  # fmt: skip


def create(topo: Topology) -> Topology:
    """Create the namespaces, veths, addresses, routes and caps (removing this prefix's stale ones first). On any
    failure everything created is removed again."""
    destroy(topo.prefix)
    try:
        for node in topo.nodes:
            ns = topo.netns(node)
            _ip("ip", "netns", "add", ns)
            _ip("ip", "-n", ns, "link", "set", "lo", "up")
            _ip("ip", "-n", ns, "addr", "add", f"{topo.address(node)}/32", "dev", "lo")
        for link in topo.links:
            _ip("ip", "link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b)
            _ip("ip", "link", "set", link.dev_a, "netns", topo.netns(link.a))
            _ip("ip", "link", "set", link.dev_b, "netns", topo.netns(link.b))
            for node, dev in ((link.a, link.dev_a), (link.b, link.dev_b)):
                _ip("ip", "-n", topo.netns(node), "link", "set", dev, "up")
            _routes(topo, link)
            _shape(topo, link)
    except BaseException:
        destroy(topo.prefix)
        raise
    return topo


def leftovers(prefix: str) -> list[str]:
    """This prefix's namespaces and host-side interfaces that exist now."""
    found = [ns for ns in _list_netns() if ns.startswith(prefix)]
    links = _ip("ip", "-o", "link", "show", check=False).stdout.splitlines()
    for row in links:
        name = row.split(":", 2)[1].strip().split("@")[0] if row.count(":") >= 2 else ""
        if name.startswith(prefix):
            found.append(name)
    return found


def _list_netns() -> list[str]:
    if shutil.which("ip") is None:
        return []
    rows = _ip("ip", "netns", "list", check=False).stdout.splitlines()
    return [row.split()[0] for row in rows if row.strip()]


def destroy(prefix: str) -> list[str]:
    """Remove every namespace and host-side interface whose name starts with ``prefix`` (their veths and qdiscs go
    with them). The names removed; what cannot be removed raises ServiceError."""
    if not prefix or shutil.which("ip") is None:
        return []
    removed = []
    for name in leftovers(prefix):
        if name in _list_netns():
            _ip("ip", "netns", "delete", name, check=False)
        else:
            _ip("ip", "link", "delete", name, check=False)
        removed.append(name)
    left = leftovers(prefix)
    if left:
        raise ServiceError(
            f"could not remove network namespaces or links: {', '.join(left)}",
            hint="remove them by hand (`ip netns del NAME`, `ip link del NAME`), then rerun `bsr engine down`",
        )
    return removed


def cut(topo: Topology, x: str, y: str) -> Link:
    """Take the link between ``x`` and ``y`` down (on x's end: y sees its carrier go)."""
    link = topo.link(x, y)
    dev, node = (link.dev_a, link.a) if link.a == x else (link.dev_b, link.b)
    _ip("ip", "-n", topo.netns(node), "link", "set", dev, "down")
    return link


def heal(topo: Topology, x: str, y: str) -> Link:
    """Bring the link between ``x`` and ``y`` back (both ends up, routes restored)."""
    link = topo.link(x, y)
    for node, dev in ((link.a, link.dev_a), (link.b, link.dev_b)):
        _ip("ip", "-n", topo.netns(node), "link", "set", dev, "up")
    _routes(topo, link)
    return link


@dataclass(frozen=True)
class LinkState:
    """One link of a multi-host engine: ``up`` when both ends are up, else ``down`` with the node(s) whose end is
    not."""

    link: str
    up: bool
    down_at: tuple[str, ...] = ()  # the nodes whose end of the link is down


def link_states(topo: Topology) -> list[LinkState]:
    """Each link with its state: ``up`` when both ends are up, else ``down`` naming the end(s) that are not (a
    namespace that is gone reads as down)."""
    up: dict[str, bool] = {}
    for node in topo.nodes:
        done = _ip("ip", "-n", topo.netns(node), "-o", "link", "show", check=False)
        for row in done.stdout.splitlines():
            parts = row.split(":", 2)
            if len(parts) == 3:
                name = parts[1].strip().split("@")[0]
                flags = parts[2].split("<", 1)[-1].split(">", 1)[0].split(",")
                up[name] = "UP" in flags  # administratively up (NO-CARRIER only says the other end is down)
    out = []
    for link in topo.links:
        ends_down = [node for node, dev in ((link.a, link.dev_a), (link.b, link.dev_b)) if not up.get(dev, False)]
        out.append(LinkState(link.name, not ends_down, tuple(ends_down)))
    return out


# -- running inside a namespace --------------------------------------------------------------------------------------


def exec_argv(netns: str) -> list[str]:
    """The argv prefix that runs a program inside ``netns`` (iproute2 execs it: the pid is the program's)."""
    ip = shutil.which("ip")
    if ip is None:
        raise ServiceError(
            "`ip` is not installed (apt-get install -y iproute2)", hint="install iproute2, or run without --hosts netns"
        )
    return [ip, "netns", "exec", netns]


def enter(netns: str) -> None:
    """Move the calling thread into ``netns`` (threads it starts afterwards inherit it). Python 3.11 has no
    os.setns, hence libc."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(_NETNS_DIR, netns), os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise ServiceError(
                f"could not enter network namespace {netns}: {os.strerror(err)}",
                hint="--hosts netns needs root (or CAP_NET_ADMIN)",
            )
    finally:
        os.close(fd)


def call_in(netns: str | None, fn: Callable[[], T]) -> T:
    """Run ``fn`` inside ``netns`` on a thread of its own (the caller's namespace is untouched); directly when
    ``netns`` is None. Used for the health probes the supervisor makes of services in their namespaces."""
    if netns is None:
        return fn()
    value: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            enter(netns)
            value.append(fn())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(e)

    thread = threading.Thread(target=run, name=f"netns-{netns}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return value[0]


__all__ = [
    "HOLDER",
    "MASTER",
    "MODE",
    "Link",
    "LinkState",
    "Topology",
    "call_in",
    "create",
    "cut",
    "destroy",
    "enter",
    "exec_argv",
    "heal",
    "leftovers",
    "link_states",
    "prefix_for",
    "rank_node",
    "unavailable",
]
