"""The one render layer: one byte formatter (core.units.format_bytes) in every reading bsr prints, one palette."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bsr_cli.core.units import GiB, KiB, MiB, format_bytes
from bsr_cli.tui.palette import BOTH_TIERS, TIER_STYLE, tier_look

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(30)
def test_format_bytes_readings() -> None:
    assert format_bytes(525_074_432) == "500.75 MiB"  # the paper's way
    assert format_bytes(1023) == "1023 B" and format_bytes(0) == "0 B"
    assert format_bytes(2 * 1024 * GiB) == "2.00 TiB"
    assert format_bytes(None) == "—"
    # compact, for dense panels
    assert format_bytes(4 * MiB, compact=True) == "4.0 MiB"
    assert format_bytes(512 * KiB, compact=True) == "512 KiB"
    assert format_bytes(12 * GiB, compact=True) == "12 GiB"
    assert format_bytes(525_074_432, compact=True) == "501 MiB"
    # exact count first, as operators quote it
    assert format_bytes(525_074_432, exact=True) == "525,074,432 (500.75 MiB)"
    assert format_bytes(512, exact=True) == "512 B"
    # a fixed unit, for a column headed by it
    assert format_bytes(1536 * MiB, unit="MiB") == "1,536"
    assert format_bytes(MiB + MiB // 2, unit="MiB") == "1.50"


@pytest.mark.timeout(30)
def test_one_palette_for_every_tier() -> None:
    assert tier_look("mooncake") == TIER_STYLE["mooncake"] == ("M", "green")
    assert tier_look("fs") == ("F", "cyan")
    assert tier_look("nvme") == ("N", "white")  # unknown tiers read as their initial
    assert BOTH_TIERS[0] == "B"


# A byte count scaled by hand inside an f-string: {n / MiB:.1f}, {n / 2**30:.0f}, {n / (1 << 20)} ...
_HAND_FORMATTED = re.compile(r"\{[^{}]*/ ?\(?(MiB|GiB|KiB|TiB|2 ?\*\* ?\d+|1 ?<< ?\d+)\b[^{}]*\}")


@pytest.mark.timeout(30)
def test_no_other_byte_formatter() -> None:
    """Every byte count a person reads goes through format_bytes: no module scales bytes by hand in an f-string."""
    offenders = []
    for path in sorted([*(ROOT / "bsr_cli").rglob("*.py"), *(ROOT / "plugins").rglob("*.py")]):
        for no, line in enumerate(path.read_text().splitlines(), 1):
            if ('f"' in line or "f'" in line) and _HAND_FORMATTED.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


@pytest.mark.timeout(30)
def test_restore_progress_shows_the_hash_check_after_the_commit() -> None:
    """`bsr restore`'s live display: per-rank windows, then, once the engine reported the commit, a line for the
    output-hash check that names how to skip it, ended (1/1) when the answer came."""
    import io

    from bsr_cli.cli.output import Output
    from bsr_cli.cli.render.ops import HASH_CHECK, HASH_ONLY, RestoreProgress
    from bsr_cli.core.events import RestoreStarted, WindowReleased

    def shown(verify: bool | None) -> str:
        err = io.StringIO()
        progress = RestoreProgress(Output(json_mode=False, stderr=err), ranks=2)
        progress.start()
        progress.update(RestoreStarted(request="r", tokens=512, windows=1, W=4, tiers=("mooncake",)))
        for rank in (0, 1):
            progress.update(WindowReleased(request="r", rank=rank, window=0, windows=1, bytes=4096))
        if verify is not None:
            progress.check_started(verify)
        progress.stop()
        return err.getvalue()

    checked = shown(True)
    assert "rank 1 windows" in checked and HASH_CHECK in checked and "--no-verify skips it" in checked
    line = next(s for s in checked.splitlines() if HASH_CHECK in s)
    assert "1/1" in line  # the check ended with the answer
    assert HASH_ONLY in shown(False) and HASH_CHECK not in shown(False)
    assert "hash" not in shown(None)  # no commit (failed, refused, aborted): no check to show
