"""The embedded engine's life beyond one run: what it keeps across a restart, the rank processes it brings back, and
the services it stops on the way out.

- **Kept state.** Force-local markers and the settings changed at run time (B, W, filesystem concurrency) are
  written to ``STATE_DIR/persisted.json`` whenever they change and read back at the next start: the markers when
  the registration is the same, the settings when the engine starts with the options they were changed from (new
  options given to `bsr engine up --restart` win). Armed faults are never carried over: the start says how many
  were dropped (in the engine's log and in `bsr engine up`'s output).
- **Dead ranks.** A rank process that died is started again with backoff (1 s, 2 s, 4 s, ... 30 s); it takes the
  engine's current budget and filesystem concurrency before it serves (settings changes are refused while it is
  down, and wait for it to take them). Each restart is a ``rank_restarted`` event and the new pid is recorded in
  ``state.json`` (so `bsr engine status` and `down` know it). A request that meets the dead rank fails closed and
  is refused with 503 ``rank-restarting`` and when to retry (``restart_in``: until the next try); the next
  requests after the restart are served.
- **Leaving.** On ``POST /shutdown`` or SIGTERM the engine stops every process started for it: its ranks, the
  Mooncake segment holder and master recorded in ``state.json`` (a pid counts only with its recorded start time).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from bsr_cli.core import wire
from bsr_cli.core.events import RankRestarted
from bsr_cli.core.faults import FaultSpec
from bsr_cli.core.markers import Marker
from bsr_cli.engine.config import Restored
from bsr_cli.mooncake import services
from bsr_cli.runtime.coordinator import Coordinator

PERSISTED = "persisted.json"
RESTART_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
STABLE_AFTER_S = 60.0  # a rank that has run this long since its restart starts the backoff afresh
_KEPT_SETTINGS = ("w", "budget_bytes", "fs_concurrency")


class Rank(Protocol):
    rank: int

    @property
    def pid(self) -> int | None: ...

    def alive(self) -> bool: ...

    def close(self, timeout: float = 10.0) -> None: ...


# -- kept state ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeptSettings:
    """The settings an engine may change at run time (`bsr settings set`); None where one was not given."""

    w: int | None = None
    budget_bytes: int | None = None
    fs_concurrency: int | None = None

    to_wire = wire.writer()


def _armed(faults: list[FaultSpec]) -> int:
    return sum(1 for f in faults if f.count == 0 or f.fired < f.count)


@dataclass(frozen=True)
class KeptState:
    """What a restart should find: markers, the settings now and the start-up settings they were changed from."""

    registration: str
    base: KeptSettings
    settings: KeptSettings
    markers: tuple[Marker, ...]
    armed_faults: int

    to_wire = wire.writer()


def kept_state(coord: Coordinator, base: KeptSettings) -> KeptState:
    """What a restart should find: markers, the settings now and the start-up settings they were changed from."""
    s = coord.settings
    return KeptState(
        registration=coord.reg.identity,
        base=base,
        settings=KeptSettings(s.w, s.budget_bytes, s.fs_concurrency),
        markers=tuple(
            Marker(m.prompt, set(m.excluded_tiers), m.reason, m.request, m.set_at)
            for m in sorted(coord.list_markers(), key=lambda m: m.prompt)
        ),
        armed_faults=_armed(coord.list_faults()),
    )


class Keeper:
    """Writes the kept state when it changes (``save`` is cheap to call often: it compares first)."""

    def __init__(self, state: Path, coord: Coordinator, base: KeptSettings) -> None:
        self.path, self.coord, self.base = state / PERSISTED, coord, base
        self._last: KeptState | None = None

    def save(self) -> None:
        now = kept_state(self.coord, self.base)
        if now == self._last:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(now.to_wire() | {"saved_at": time.time()}, indent=1))
        tmp.replace(self.path)
        self._last = now


def restore(state: Path, coord: Coordinator, base: KeptSettings) -> Restored:
    """Bring back what the last run kept; what was restored and what was dropped, with one line per fact."""
    try:
        kept = json.loads((state / PERSISTED).read_text())
    except (OSError, ValueError):
        return Restored()
    if not isinstance(kept, dict):
        return Restored()
    lines: list[str] = []
    if kept.get("registration") != coord.reg.identity:
        lines.append("the previous run's markers and settings were for another registration: not restored")
        return Restored(lines=tuple(lines))
    markers = [m for m in kept.get("markers") or [] if isinstance(m, dict) and m.get("prompt")]
    coord.restore_markers(
        Marker(
            str(m["prompt"]),
            {str(t) for t in m.get("excluded_tiers") or [] if str(t) in coord.settings.tiers},
            str(m.get("reason") or "restored"),
            str(m.get("request") or "previous run"),
            float(m.get("set_at") or time.time()),
        )
        for m in markers
    )
    if markers:
        lines.append(f"restored {len(markers)} force-local marker(s) from the previous run")
    saved = kept.get("settings") or {}
    base_wire = base.to_wire()
    changed = {k: saved[k] for k in _KEPT_SETTINGS if k in saved and saved[k] != base_wire[k]}
    restored_settings: dict[str, int] = {}
    if changed and (kept.get("base") or {}) == base_wire:
        try:
            coord.update_settings(
                budget_bytes=changed.get("budget_bytes"),
                fs_concurrency=changed.get("fs_concurrency"),
                w=changed.get("w"),
            )
            restored_settings = changed
            lines.append(
                "restored the settings changed at run time: "
                + ", ".join(f"{k} {v}" for k, v in sorted(changed.items()))
            )
        except Exception as e:  # noqa: BLE001 - a kept setting this engine refuses is reported, not fatal
            lines.append(f"the previous run's settings were not restored: {getattr(e, 'message', e)}")
    elif changed:
        lines.append("the settings changed in the previous run were dropped: this engine starts with other options")
    dropped = int(kept.get("armed_faults") or 0)
    if dropped:
        lines.append(f"dropped {dropped} armed fault(s) of the previous run (faults never survive a restart)")
    return Restored(len(markers), restored_settings, dropped, tuple(lines))


# -- dead ranks --------------------------------------------------------------------------------------------------


class RankRestarter:
    """Called from the engine's main loop: restarts dead ranks with backoff. ``start(i)`` builds rank ``i`` afresh
    (blocking while the process starts); ``on_restart(rank, pid, restarts)`` records it. The coordinator asks it
    when a dead rank is next tried (``restart_in``), to tell a request that met it when to retry."""

    def __init__(
        self,
        coord: Coordinator,
        start: Callable[[int], Rank],
        on_restart: Callable[[int, int | None, int], None],
        log: Callable[[str], None],
        backoff: tuple[float, ...] = RESTART_BACKOFF_S,
    ) -> None:
        self.coord, self.start, self.on_restart, self.log, self.backoff = coord, start, on_restart, log, backoff
        n = len(coord.ranks)
        self.restarts = [0] * n
        self._attempt = [0] * n  # failures in a row since the rank last ran stably
        self._next_try = [0.0] * n
        self._since = [time.monotonic()] * n
        self._starting: set[int] = set()  # ranks whose process is being started now
        coord.restart_ranks_with(self)

    def restart_in(self, rank: int) -> float:
        """Seconds until rank ``rank`` is next tried (0: it is being started now, or is tried at the next check)."""
        if rank in self._starting or not 0 <= rank < len(self._next_try):
            return 0.0
        return max(0.0, self._next_try[rank] - time.monotonic())

    def check(self) -> None:
        now = time.monotonic()
        for i, rank in enumerate(list(self.coord.ranks)):
            if rank.alive():  # type: ignore[attr-defined]
                if now - self._since[i] > STABLE_AFTER_S:
                    self._attempt[i] = 0
                continue
            if now < self._next_try[i]:
                continue
            self._restart(i, rank)

    def _restart(self, i: int, old: Any) -> None:
        old.close(timeout=2.0)
        # Once it is reaped, how it went (a signal, an exit code): the reason its rank_restarted event carries.
        why = getattr(old, "down_reason", None) or "process exited"
        self.log(f"bsr engine: rank {i} is not running ({why}): restarting it")
        self._starting.add(i)
        new = None
        try:
            new = self.start(i)
            self.coord.replace_rank(i, new)  # type: ignore[arg-type]  # once it took the engine's settings
        except Exception as e:  # noqa: BLE001 - retried after the backoff
            if new is not None:
                new.close(timeout=2.0)
            pause = self.backoff[min(self._attempt[i], len(self.backoff) - 1)]
            self._attempt[i] += 1
            self._next_try[i] = time.monotonic() + pause
            self.log(f"bsr engine: rank {i} did not start ({e}); next try in {pause:g}s")
            return
        finally:
            self._starting.discard(i)
        pause = self.backoff[min(self._attempt[i], len(self.backoff) - 1)]
        self._attempt[i] += 1
        self._next_try[i] = time.monotonic() + pause  # a rank that dies again at once waits longer each time
        self._since[i] = time.monotonic()
        self.restarts[i] += 1
        self.coord.events.append(RankRestarted(rank=i, pid=new.pid or 0, restarts=self.restarts[i], reason=why))
        self.on_restart(i, new.pid, self.restarts[i])
        self.log(f"bsr engine: rank {i} restarted (pid {new.pid}, restart {self.restarts[i]})")


# -- leaving -----------------------------------------------------------------------------------------------------


def stop_services(state: Path) -> list[str]:
    """Stop the Mooncake services recorded for this engine (segment holder first: it would otherwise spend its
    shutdown retrying a gone master). The names of those stopped."""
    try:
        st = json.loads((state / "state.json").read_text())
    except (OSError, ValueError):
        return []
    stopped = []
    for name in ("segment_holder", "mooncake_master"):
        rec = (st.get("services") or {}).get(name)
        if not rec:
            continue
        pid, ticks = int(rec["pid"]), rec.get("start_ticks")
        ticks = None if ticks is None else int(ticks)
        if services.is_alive(pid, ticks):
            services.stop(pid, timeout=10.0, start_ticks=ticks)
            stopped.append(name)
    return stopped


__all__ = [
    "PERSISTED",
    "Keeper",
    "KeptSettings",
    "KeptState",
    "RankRestarter",
    "Restored",
    "kept_state",
    "restore",
    "stop_services",
]
