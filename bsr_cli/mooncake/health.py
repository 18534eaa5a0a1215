"""Health probes of a running Mooncake deployment: the master's HTTP health, a TCP port's reachability and the
master's segment listing. Standard library only (the CLI's store probe and both plugins use it), no process control:
that is `bsr_cli.mooncake.services`."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

from bsr_cli.core import wire
from bsr_cli.errors import ServiceError

LOOPBACK = "127.0.0.1"
_HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float) -> tuple[int, str] | None:
    """(status, body) or None when nothing answered."""
    try:
        with _HTTP.open(url, timeout=max(timeout, 0.001)) as resp:
            return resp.status, resp.read(1 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError):
        return None


def health_url_for(url: str) -> str:
    """Accept a base URL, the metadata URL (…/metadata) or the health URL itself."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, "/health", "", ""))


def master_healthy(http_url: str, timeout: float = 1.0) -> bool:
    """HTTP probe of the master: its metadata server's ``/health`` (body ``OK``) or its admin ``/health`` (JSON,
    ``service_ready``). Needed because the store client's own ``health_check()`` keeps answering 0 after the
    master died."""
    got = http_get(health_url_for(http_url), timeout)
    if got is None or got[0] != 200:
        return False
    body = got[1].strip()
    if body == "OK":
        return True
    try:
        doc = json.loads(body)
    except ValueError:
        return False
    return isinstance(doc, dict) and doc.get("status") == "ok" and doc.get("service_ready", True) is True


def tcp_answer(address: str, timeout: float = 0.5) -> bool | None:
    """Whether something accepts TCP connections at ``host:port``: True when it does, False when the connection is
    refused (nothing listens there: the process is gone), None when nothing answered in time or the address is
    not one (unknown, never taken for gone). A stopped process still accepts: the kernel completes the handshake."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or LOOPBACK, int(port)), timeout=max(timeout, 0.001)):
            return True
    except ConnectionRefusedError:
        return False
    except (OSError, ValueError):
        return None


def tcp_reachable(address: str, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections at ``host:port`` (e.g. the master's RPC port)."""
    return tcp_answer(address, timeout) is True


def holder_endpoint(metadata_url: str, segment: str, fallback: str, timeout: float) -> str:
    """Where a segment's holder serves its bytes: the transfer engine's TCP data port (or its RPC port) from the
    segment descriptor on the metadata server; ``fallback`` (the master's te_endpoint) when it cannot be read."""
    if not metadata_url.startswith("http") or not segment:
        return fallback
    for key, host_f, port_f in (
        (f"mooncake/ram/{segment}", "tcp_data_host", "tcp_data_port"),
        (f"mooncake/rpc_meta/{segment}", "ip_or_host_name", "rpc_port"),
    ):
        got = http_get(f"{metadata_url}?key={urllib.parse.quote(key, safe='')}", timeout)
        if got is None or got[0] != 200:
            continue
        try:
            doc = json.loads(got[1])
        except ValueError:
            continue
        if isinstance(doc, dict) and doc.get(host_f) and doc.get(port_f):
            return f"{doc[host_f]}:{doc[port_f]}"
    return fallback


def check_holder(metadata_url: str, name: str, te_endpoint: str) -> tuple[str, bool | None]:
    """(data endpoint, whether it accepts a connection); None when no HOST:PORT to try is known (unknown)."""
    ep = holder_endpoint(metadata_url, name, te_endpoint or name, timeout=1.0)
    host, _, port = ep.rpartition(":")
    if not host or not port.isdigit():
        return ep, None
    return ep, tcp_reachable(ep, timeout=0.5)


@dataclass(frozen=True)
class MountedSegment:
    """A segment in the master's listing, as far as bsr reads it (its other keys are left to `segment_listing`)."""

    segment_name: str
    client_id: str
    status: str  # the master's word for it: "OK" once mounted
    size_bytes: int | None  # None when the master does not say
    te_endpoint: str  # its transfer engine's data endpoint, host:port

    from_wire = wire.reader()

    @property
    def mounted(self) -> bool:
        return self.status == "OK"


def segment_listing(admin_url: str, timeout: float = 2.0) -> list[wire.JsonObject]:
    """The master's segments (``/get_segments_detail`` on its admin/metrics port) as it sent them, every key kept
    (`bsr bundle` copies them whole; `segments` reads them). Raises ServiceError."""
    got = http_get(admin_url.rstrip("/") + "/get_segments_detail", timeout)
    if got is None or got[0] != 200:
        raise ServiceError(
            f"mooncake master admin API at {admin_url} did not answer",
            hint="is the Mooncake master running with its admin API? `bsr engine status` lists the services",
        )
    try:
        doc = json.loads(got[1])
    except ValueError as exc:
        raise ServiceError(
            f"mooncake master admin API at {admin_url} sent malformed JSON",
            hint="is this address the Mooncake master's admin API (port 9003 by default)?",
        ) from exc
    found = doc.get("segments", []) if isinstance(doc, dict) else []
    return [s for s in found if isinstance(s, dict)]


def all_keys(admin_url: str, timeout: float = 10.0) -> list[str]:
    """Every key the master lists (``/get_all_keys`` on its admin/metrics port): a JSON list (or ``{"keys": [...]}``),
    or, from a build that answers in plain text, the keys one a line. Raises OSError when it cannot be read."""
    with _HTTP.open(admin_url.rstrip("/") + "/get_all_keys", timeout=max(timeout, 0.001)) as resp:
        text = resp.read().decode("utf-8", "replace")
    try:
        listed = json.loads(text)
        return [str(k) for k in (listed if isinstance(listed, list) else listed.get("keys", []))]
    except json.JSONDecodeError:
        return [line.strip() for line in text.replace(",", "\n").splitlines() if "@" in line]


def segments(admin_url: str, timeout: float = 2.0) -> list[MountedSegment]:
    """The master's segments (``/get_segments_detail`` on its admin/metrics port). Raises ServiceError."""
    return [MountedSegment.from_wire(s) for s in segment_listing(admin_url, timeout)]
