"""`bsr bundle`: an incident archive for a ticket (see bsr_cli.incident_bundle for what is inside)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.context import JsonFlag, state
from bsr_cli.core import wire
from bsr_cli.core.events import known_event
from bsr_cli.errors import BsrError, InvalidInput

if TYPE_CHECKING:
    from bsr_cli.client import AdminClient
    from bsr_cli.core.explain import Explanation
    from bsr_cli.incident_bundle import Builder, Manifest


def bundle(
    ctx: typer.Context,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Archive to write [default: bsr-incident-TIME.tar.gz].")
    ] = None,
    synthetic: Annotated[
        list[int] | None, typer.Option("--synthetic", help="Explain this synthetic prompt of N tokens (repeatable).")
    ] = None,
    seed: Annotated[list[int] | None, typer.Option("--seed", help="Seed of each --synthetic prompt, in order.")] = None,
    tokens_file: Annotated[
        list[Path] | None, typer.Option("--tokens-file", help="Explain the prompt in this token file (repeatable).")
    ] = None,
    max_bytes: Annotated[
        str, typer.Option("--max-bytes", help="Size cap of the contents (log tails, then oldest events, are cut).")
    ] = "16MiB",
    since: Annotated[
        str, typer.Option("--since", help="Events from this far back (30m, 2h, 1d) or since an ISO time.")
    ] = "1h",
    master_admin: Annotated[
        str | None,
        typer.Option("--master-admin", help="Mooncake master admin URL for its segments [default: the embedded one]."),
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Write an incident archive: status, settings, registration, markers, faults, the events of the last hour
    (--since) from the engine's event store, pool history, master segments, versions, engine log tails (the
    engine's and each rank's failure log included) and `explain` of the prompts given; token ids and secrets
    redacted.

    Read it back with `bsr top --replay BUNDLE` (the incident frame by frame), `bsr describe REQ --record BUNDLE`,
    or `tar xzf BUNDLE`.
    """
    from bsr_cli import incident_bundle as ib
    from bsr_cli.client import AdminClient
    from bsr_cli.client.admin import resolve_engine
    from bsr_cli.core.units import parse_bytes
    from bsr_cli.core.when import parse_since

    st = state(ctx, json_flag)
    t_from = parse_since(since, time.time())
    cap = parse_bytes(max_bytes)
    if cap < 64 << 10:
        raise InvalidInput("--max-bytes must be at least 64KiB", hint="give --max-bytes 64KiB or more, e.g. 4MiB")
    prompts = _prompts(synthetic or [], seed or [], tokens_file or [])
    out = output or Path(time.strftime("bsr-incident-%Y%m%d-%H%M%S.tar.gz"))
    url, token, how = resolve_engine(st.settings)
    b = ib.Builder([token or ""])
    manifest = ib.Manifest(created=time.time(), engine=url, found_via=how)
    with AdminClient(url, token, timeout_s=st.settings.timeout_s) as client:
        _add_engine_state(b, client, url, t_from)
        for name, n_tok, s_seed, path in prompts:
            try:
                b.json(f"explain/{name}.json", _explain(st, n_tok, s_seed, path).to_wire())
            except BsrError as e:
                manifest.missing[f"explain/{name}.json"] = e.message
    local = _local_engine(st, url)
    _add_segments(b, manifest.missing, master_admin or (local.mooncake_admin_url if local is not None else None))
    logs = Path(st.settings.state_dir) / "logs"
    if local is not None and logs.is_dir():
        for p in sorted(logs.glob("*.log")):
            b.text(f"logs/{p.name}", ib.tail(p))
    else:
        manifest.missing["logs/"] = "the engine's logs are not on this machine (its state directory is elsewhere)"
    b.fit(cap)
    size = b.write(out, manifest)
    st.out.result(BundleWritten(out, size, tuple(sorted(b.files)), tuple(b.notes), manifest), _render)


@dataclass(frozen=True)
class BundleWritten:
    """`bsr bundle`'s result: the archive, its size, the files in it (besides the manifest), what was cut to fit
    the size cap, and the manifest."""

    bundle: Path
    bytes: int
    files: tuple[str, ...]
    notes: tuple[str, ...]
    manifest: Manifest

    def to_wire(self) -> wire.JsonObject:
        head: wire.JsonObject = {
            "bundle": str(self.bundle),
            "bytes": self.bytes,
            "files": list(self.files),
            "notes": list(self.notes),
        }
        return head | asdict(self.manifest)


# A prompt to explain: (its name in the bundle, synthetic tokens or None, seed, token file or None).
_Prompt = tuple[str, int | None, int, Path | None]


def _prompts(synthetic: list[int], seeds: list[int], tokens_files: list[Path]) -> list[_Prompt]:
    """The prompts to explain: each --synthetic N with its --seed (0 when fewer seeds were given), then each file."""
    prompts: list[_Prompt] = []
    for i, n in enumerate(synthetic):
        s_i = seeds[i] if i < len(seeds) else 0
        prompts.append((f"synthetic-{n}-seed-{s_i}", n, s_i, None))
    return prompts + [(f"tokens-{p.stem}", None, 0, p) for p in tokens_files]


def _add_engine_state(b: Builder, client: AdminClient, url: str, t_from: float) -> None:
    """What the engine itself says: status, health, info, registration, markers, faults, quarantine, the events
    since ``t_from`` with the pool history they give, the recording rebuilt from them, and the versions (this
    bsr's, its packages' and the engine's)."""
    from bsr_cli import incident_bundle as ib

    t0 = time.monotonic()
    snapshot = client.snapshot(health=True, events_since=0)
    latency = time.monotonic() - t0
    received = time.time()
    snap = snapshot.to_wire()
    health_answer = client.health()
    health = health_answer.to_wire()
    info = snapshot.info
    b.json("status.json", {k: v for k, v in snap.items() if k != "events"})
    b.json("health.json", health)
    b.json("info.json", info.to_wire())
    b.json("versions.json", asdict(ib.versions()) | {"engine": info.version, "api": info.api})
    b.json("registration.json", client.registration().to_dict())
    b.json("markers.json", snap.get("markers") or [])
    b.json("faults.json", client.faults().to_wire())
    b.json("quarantine.json", ib.quarantine_list(health_answer))
    # The engine's events since --since, from its durable store (the snapshot carries only the newest).
    held, _ = client.held_wire(0, after=t_from)
    b.events("events.jsonl", held)  # as the engine sent them
    events = [e for w in held if (e := known_event(w)) is not None]
    b.json("pool-history.json", ib.pool_history(events))
    # The recording: the incident frame by frame rebuilt from those events, then the snapshot. Its frames leave
    # the events to events.jsonl (read back into them with the bundle), so the size cap, which cuts
    # events.jsonl, bounds both.
    frame = {k: v for k, v in snap.items() if k != "events"} | {"events": []}

    def clean(obj: Any) -> Any:
        return json.loads(ib.redact_text(json.dumps(ib.redact_tokens(obj), default=str), b.secrets))

    history = [clean(h) for h in ib.history_frames(frame, events)]
    b.raw(ib.RECORDING, ib.recording_bytes(clean(frame), received, latency, url, history))


def _add_segments(b: Builder, missing: dict[str, str], admin: str | None) -> None:
    """The Mooncake master's mounted segments, from its admin address; or why they are missing."""
    if not admin:
        missing["segments.json"] = "no Mooncake master admin address (pass --master-admin)"
        return
    from bsr_cli.errors import ServiceError
    from bsr_cli.mooncake import health as mooncake_health

    try:
        b.json("segments.json", mooncake_health.segment_listing(admin))
    except ServiceError as e:
        missing["segments.json"] = str(e)


def _render(console: Any, d: BundleWritten) -> None:
    console.print(f"wrote {d.bundle} ({d.bytes:,} bytes, {len(d.files) + 1} files); redacted: token ids, secrets")
    for n in d.notes:
        console.print(f"  cut: {n}")
    for name, why in d.manifest.missing.items():
        console.print(f"  [dim]not included: {name}: {why}[/]")
    console.print(f"read it back: bsr top --replay {d.bundle}  ·  bsr describe REQ --record {d.bundle}")


def _explain(st: Any, n: int | None, seed: int, path: Path | None) -> Explanation:
    from bsr_cli.cli.commands.explain_cmd import _explain_prompt
    from bsr_cli.cli.commands.probe_options import PromptFlags

    return _explain_prompt(st, path, None, n, seed, None, PromptFlags(path, None, n, seed).as_flags())


@dataclass(frozen=True)
class _LocalEngine:
    """What the bundle needs of the embedded engine's configuration (``engine.json``)."""

    mooncake_admin_url: str | None


def _local_engine(st: Any, url: str) -> _LocalEngine | None:
    """The embedded engine recorded in this state directory, when ``url`` is that engine."""
    from bsr_cli.client.local_engine import connection

    state_dir = Path(st.settings.state_dir)
    found = connection(state_dir)
    if found is None or found[0].rstrip("/") != url.rstrip("/"):
        return None
    try:
        config = dict(json.loads((state_dir / "engine.json").read_text()))
    except (OSError, ValueError):
        return None
    return _LocalEngine((config.get("mooncake") or {}).get("admin_url"))
