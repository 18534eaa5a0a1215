"""Watch a Mooncake master for the segments it loses, and every object on them with each.

Mooncake forgets a segment in three ways, and none of them tells its clients: the master unmounts a holder that
missed its heartbeats for the client TTL (``--client_ttl``; the holder process may well live on, stopped or starved,
and mounts its segment again, empty, when it runs), an operator unmounts it, or the holder dies (the master then
keeps listing the segment, and probing its objects as held, until the TTL runs out, while every read of them
fails). A reader sees only objects that are no longer there. This watch looks at the master's admin API every time
it is polled and names each loss once:

* a segment listed at the last look and not now: ``unmounted``;
* a segment listed at both looks whose holder mounted it again in between (the master's remount counter rose and
  the segment holds fewer bytes, or another client holds its name now): ``remounted_empty``;
* a listed segment whose holder refuses connections (nothing listens at its data endpoint any more): ``holder_gone``.
  A stopped holder still accepts connections (the kernel completes the handshake), and one that does not answer
  in time is unknown, never gone.

How many objects went comes from the master's key count between the two looks (exact unless other writes or
removals happened in between; unknown when several segments went at once), the bytes from the segment's own
allocated bytes. Standard library only (the engine and the bench poll it; the CLI's start-up path never imports it).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bsr_cli.core.evidence import SegmentLossCause
from bsr_cli.core.store_loss import SegmentLoss
from bsr_cli.errors import ServiceError
from bsr_cli.mooncake.health import MountedSegment, holder_endpoint, http_get, segments, tcp_answer

# One sample of the master's Prometheus text: name, optional {labels}, value.
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_SEGMENT_LABEL = re.compile(r'segment="([^"]*)"')
KEYS = "master_key_count"
REMOUNTS = "master_remount_segment_requests_total"
SEGMENT_BYTES = "segment_allocated_bytes"
HOLDER_ANSWER_S = 0.5


@dataclass(frozen=True)
class StoreSnapshot:
    """What the master says at one look: its mounted segments, its key count, each segment's allocated bytes and
    how many remounts it has served (None where its metrics did not say)."""

    at: float
    segments: tuple[MountedSegment, ...]
    keys: int | None = None
    remounts: int | None = None
    allocated: dict[str, int] = field(default_factory=dict)

    def by_name(self) -> dict[str, MountedSegment]:
        return {s.segment_name: s for s in self.segments}


def parse_metrics(text: str) -> tuple[int | None, int | None, dict[str, int]]:
    """(key count, remount requests, allocated bytes per segment) from the master's /metrics text."""
    keys = remounts = None
    allocated: dict[str, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, labels, raw = m.groups()
        try:
            value = int(float(raw))
        except ValueError:
            continue
        if name == KEYS:
            keys = value
        elif name == REMOUNTS:
            remounts = value
        elif name == SEGMENT_BYTES and labels:
            seg = _SEGMENT_LABEL.search(labels)
            if seg is not None:
                allocated[seg.group(1)] = value
    return keys, remounts, allocated


def read_snapshot(admin_url: str, timeout: float = 2.0, now: float | None = None) -> StoreSnapshot:
    """One look at the master (its segment listing and its metrics). Raises ServiceError when the listing cannot
    be read; metrics that cannot be read leave the counts unknown."""
    mounted = tuple(s for s in segments(admin_url, timeout=timeout) if s.mounted)
    got = http_get(admin_url.rstrip("/") + "/metrics", timeout)
    keys, remounts, allocated = parse_metrics(got[1]) if got is not None and got[0] == 200 else (None, None, {})
    return StoreSnapshot(time.time() if now is None else now, mounted, keys, remounts, allocated)


def losses_between(
    before: StoreSnapshot,
    after: StoreSnapshot,
    *,
    already_lost: Mapping[str, SegmentLoss] | None = None,
    holder_gone: Callable[[MountedSegment], bool] = lambda _s: False,
    label: Callable[[str], str] = lambda _name: "",
) -> list[SegmentLoss]:
    """The segments lost between two looks (those in ``already_lost`` are not named again): dropped, dropped and
    mounted again, or listed with their holder gone. Pure but for ``holder_gone``."""
    lost_before = already_lost or {}
    was, now = before.by_name(), after.by_name()
    remounted = (after.remounts or 0) > (before.remounts or 0)
    found: list[tuple[MountedSegment, SegmentLossCause]] = []
    for name, seg in was.items():
        if name in lost_before:
            continue
        if name not in now:
            found.append((seg, SegmentLossCause.UNMOUNTED))
        elif now[name].client_id != seg.client_id or (
            remounted and after.allocated.get(name, 0) < before.allocated.get(name, 0)
        ):
            found.append((seg, SegmentLossCause.REMOUNTED_EMPTY))
    named = {seg.segment_name for seg, _ in found}
    for name, seg in now.items():
        if name not in lost_before and name not in named and holder_gone(seg):
            found.append((seg, SegmentLossCause.HOLDER_GONE))
    dropped_keys = None
    if before.keys is not None and after.keys is not None and before.keys >= after.keys:
        dropped_keys = before.keys - after.keys
    out = []
    for seg, cause in found:
        if cause is SegmentLossCause.HOLDER_GONE:
            # Still listed: its objects are still counted, and all of the master's are its when it is the only one.
            objects = after.keys if len(now) == 1 else None
            nbytes = after.allocated.get(seg.segment_name)
        else:
            objects = dropped_keys if len(found) == 1 else None
            nbytes = before.allocated.get(seg.segment_name)
        out.append(
            SegmentLoss(
                segment=seg.segment_name,
                client_id=seg.client_id,
                cause=cause,
                lost_at=after.at,
                last_seen_at=before.at if seg.segment_name in was else None,
                objects_lost=objects,
                bytes_lost=nbytes,
                holder=label(seg.segment_name),
            )
        )
    return out


def _here(fn: Callable[[], Any]) -> Any:
    return fn()


class SegmentWatch:
    """Polls one master and remembers what it saw: ``poll()`` returns the segments lost since the last poll, each
    named once; ``losses`` holds every loss seen, a segment mounted again since carrying ``remounted_at``.

    ``metadata_url`` lets it find each holder's data endpoint (to tell a dead holder from a stopped one); without
    it holders are not checked. ``label`` names the holder process of a segment where the caller knows it;
    ``probe_in`` runs each look where the master is reachable (a network namespace). Not thread-safe: one poller."""

    def __init__(
        self,
        admin_url: str,
        metadata_url: str = "",
        *,
        label: Callable[[str], str] = lambda _name: "",
        probe_in: Callable[[Callable[[], Any]], Any] | None = None,
        timeout: float = 2.0,
    ) -> None:
        self.admin_url, self.metadata_url = admin_url, metadata_url
        self._label, self._probe_in, self._timeout = label, probe_in or _here, timeout
        self._last: StoreSnapshot | None = None
        self._lost: dict[str, SegmentLoss] = {}  # lost and not mounted again since, by segment name
        self._endpoints: dict[tuple[str, str], str] = {}  # (segment, client id) -> its holder's data endpoint
        self.losses: list[SegmentLoss] = []

    def poll(self) -> list[SegmentLoss]:
        """One look; the new losses. A master that does not answer is no loss (its own condition says so)."""
        try:
            snap: StoreSnapshot = self._probe_in(lambda: read_snapshot(self.admin_url, self._timeout))
        except ServiceError:
            return []
        before = self._last or replace(snap, segments=())
        new = losses_between(before, snap, already_lost=self._lost, holder_gone=self._holder_gone, label=self._label)
        for loss in new:
            self._lost[loss.segment] = loss
            self.losses.append(loss)
        self._note_remounts(snap, {x.segment for x in new})
        self._last = snap
        return new

    def _note_remounts(self, snap: StoreSnapshot, just_lost: set[str]) -> None:
        """A lost segment listed again (its holder came back, empty; or a new holder took its name) is lost no
        longer: a later loss of it is a new one."""
        listed = snap.by_name()
        for name in [n for n in self._lost if n in listed and n not in just_lost]:
            if (
                self._lost[name].cause is SegmentLossCause.HOLDER_GONE
                and listed[name].client_id == self._lost[name].client_id
            ):
                continue  # the dead holder's segment, still listed until its TTL runs out
            back = replace(self._lost.pop(name), remounted_at=snap.at)
            self.losses = [back if x.segment == name and x.remounted_at is None else x for x in self.losses]

    def _holder_gone(self, seg: MountedSegment) -> bool:
        if not self.metadata_url:
            return False
        key = (seg.segment_name, seg.client_id)
        if key not in self._endpoints:
            self._endpoints[key] = self._probe_in(
                lambda: holder_endpoint(self.metadata_url, seg.segment_name, seg.te_endpoint or seg.segment_name, 1.0)
            )
        endpoint = self._endpoints[key]
        return bool(self._probe_in(lambda: tcp_answer(endpoint, HOLDER_ANSWER_S)) is False)


__all__ = ["SegmentWatch", "StoreSnapshot", "losses_between", "parse_metrics", "read_snapshot"]
