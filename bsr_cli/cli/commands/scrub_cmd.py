"""`bsr scrub`: read a tier's objects back whole on every rank, set the damaged ones apart, and say what it found.

The engine does the reading (POST /scrub, each rank its own objects); while it runs, a person at a terminal sees
each rank's progress (from the tier status the ranks report), then the summary. Exit 0: every object in scope read
back intact; 20: damaged objects found (set aside, the next store rewrites them); 21: not everything was read (a
limit, a tier that could not be read, a rank already scrubbing).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any

import typer

from bsr_cli.cli.commands.operate import PromptFileOpt, SeedOpt, SyntheticOpt, TokensFileOpt, _client, _prompt
from bsr_cli.cli.commands.probe_options import PromptFlags
from bsr_cli.cli.context import AppState, JsonFlag, state
from bsr_cli.errors import BsrError, DamagedObjects, ExitCode, InvalidInput, ScrubIncomplete

if TYPE_CHECKING:
    from bsr_cli.core.scrub import ScrubLimits, ScrubReport

POLL_S = 1.0  # how often a person's progress lines are refreshed


def scrub(
    ctx: typer.Context,
    tier: Annotated[
        str,
        typer.Option(
            "--tier", metavar="TIER", help="The tier to scrub: one that checks its own objects (fs, mooncake)."
        ),
    ],
    tokens_file: TokensFileOpt = None,
    prompt_file: PromptFileOpt = None,
    synthetic: SyntheticOpt = None,
    seed: SeedOpt = 0,
    all_objects: Annotated[bool, typer.Option("--all", help="Every object the tier holds, not one prompt's.")] = False,
    max_objects: Annotated[
        int | None, typer.Option("--max-objects", min=1, help="Read at most this many objects per rank.")
    ] = None,
    max_bytes: Annotated[
        str | None, typer.Option("--max-bytes", help="Read at most this many bytes per rank (e.g. 4GiB).")
    ] = None,
    json_flag: JsonFlag = False,
) -> None:
    """Read a tier's objects back whole and check them: one prompt's, or every object (--all). Damaged objects are
    moved aside and the next store rewrites them. Exit 0 clean, 20 damaged objects found, 21 not everything read."""
    from bsr_cli.cli.render import ops as render_ops

    st = state(ctx, json_flag)
    prompt = PromptFlags(tokens_file, prompt_file, synthetic, seed)
    if prompt.given() + all_objects != 1:
        raise InvalidInput(
            "give exactly one of --tokens-file, --prompt-file, --synthetic N or --all",
            hint="a prompt scrubs its own objects; --all scrubs every object the tier holds",
        )
    limits = _limits(max_objects, max_bytes)
    with _client(st) as client:
        tiers = list(client.info().tiers)
        if tier not in tiers:
            raise InvalidInput(f"this engine has no tier {tier!r}", hint=f"its tiers: {', '.join(tiers)}")
        body = None if all_objects else _prompt(client, tokens_file, prompt_file, synthetic, seed)
        report = _run(st, client, lambda: client.scrub(tier, body, limits))
    error = _scrub_error(report, tier)
    if error is not None:
        st.out.fail(report, render_ops.scrub, error)
    st.out.result(report, render_ops.scrub)


def _scrub_error(report: ScrubReport, tier: str) -> BsrError | None:
    """What a scrub that found damage (20) or did not read everything (21) ends with; None when it is clean."""
    code = report.exit_code
    if code is ExitCode.DAMAGED_OBJECTS:
        return DamagedObjects(
            f"{report.damaged} damaged object(s) found on tier {tier} ({len(report.quarantined)} set aside)",
            hint="the next store rewrites them (`bsr submit` the prompt); `bsr bundle` keeps the quarantined files' "
            "list for the incident, and the tier's storage deserves a look",
        )
    if code is ExitCode.SCRUB_INCOMPLETE:
        why = "; ".join(f"rank {r.rank} {r.state.value}: {r.reason}" for r in report.ranks if r.reason)
        return ScrubIncomplete(
            f"the scrub of tier {tier} did not read every object" + (f" ({why})" if why else ""),
            hint="raise --max-objects/--max-bytes, or run it again once the running scrubs are done (`bsr status`)",
        )
    return None


def _limits(max_objects: int | None, max_bytes: str | None) -> ScrubLimits:
    from bsr_cli.core.scrub import MAX_BYTES, MAX_OBJECTS, ScrubLimits
    from bsr_cli.core.units import format_bytes, parse_bytes

    nbytes = MAX_BYTES if max_bytes is None else parse_bytes(max_bytes)
    if not 1 <= nbytes <= MAX_BYTES:
        raise InvalidInput(
            f"--max-bytes must be between 1 B and {format_bytes(MAX_BYTES)}, got {max_bytes}",
            hint=f"e.g. --max-bytes 64GiB; without it a scrub reads up to {format_bytes(MAX_BYTES)}",
        )
    if max_objects is not None and max_objects > MAX_OBJECTS:
        raise InvalidInput(
            f"--max-objects must be at most {MAX_OBJECTS:,}, got {max_objects:,}",
            hint=f"leave --max-objects out to read up to {MAX_OBJECTS:,} objects per rank",
        )
    return ScrubLimits(max_objects or MAX_OBJECTS, nbytes)


@dataclass
class _Answer:
    report: ScrubReport | None = None
    error: BaseException | None = None


def _run(st: AppState, client: Any, call: Any) -> ScrubReport:
    """``call`` (the scrub) on a worker thread; meanwhile, for a person at a terminal, each rank's progress."""
    answer = _Answer()
    done = threading.Event()

    def work() -> None:
        try:
            answer.report = call()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            answer.error = e
        finally:
            done.set()

    threading.Thread(target=work, name="bsr-scrub", daemon=True).start()
    shown: dict[str, str] = {}
    while not done.wait(POLL_S):
        if st.out.interactive:
            _show_progress(st, client, shown)
    if answer.error is not None:
        raise answer.error
    assert answer.report is not None
    return answer.report


def _show_progress(st: AppState, client: Any, shown: dict[str, str]) -> None:
    """One line per running scrub whose progress moved since it was last shown."""
    from bsr_cli.client import AdminClient
    from bsr_cli.core.evidence import ScrubState
    from bsr_cli.errors import BsrError

    try:
        with AdminClient(client.url, client.token, timeout_s=5.0) as poll:
            entries = poll.pool(health=True)
    except BsrError:
        return  # progress is a courtesy: the scrub's own answer is what counts
    for entry in entries:
        for t in (entry.tiers or {}).values():
            for p in t.scrubs:
                line = p.describe()
                if p.state is ScrubState.RUNNING and shown.get(p.scrub) != line:
                    shown[p.scrub] = line
                    st.out.note(line)
