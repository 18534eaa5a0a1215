"""`bsr inject-fault` refuses, before it asks the engine, a fault no restore could ever fire: a rank the engine does
not have, a window past its longest prompt's last (at W=1). What the engine says of a fault it does arm is
tests/engine's."""

from __future__ import annotations

import pytest

from bsr_cli.core.faults import check_fault_target
from bsr_cli.errors import ExitCode, InvalidInput

ENGINE = {"ranks": 2, "chunk_size": 256, "max_tokens": 1000}  # 4 chunks: windows G1..G4 at W=1


@pytest.mark.parametrize(("rank", "window"), [(None, None), (0, 1), (1, 4), (None, 4)])
def test_a_fault_some_restore_can_fire_is_let_through(rank: int | None, window: int | None) -> None:
    check_fault_target(rank, window, **ENGINE)


@pytest.mark.parametrize(
    ("rank", "window", "says"),
    [
        (2, None, "--rank 2: this engine has 2 rank(s), 0..1"),
        (None, 5, "--window 5: this engine's longest prompt has at most 4 windows (at W=1)"),
        (2, 5, "--rank 2"),  # the rank is named first
    ],
)
def test_a_fault_no_restore_can_fire_is_invalid_input(rank: int | None, window: int | None, says: str) -> None:
    with pytest.raises(InvalidInput) as refused:
        check_fault_target(rank, window, **ENGINE)
    assert refused.value.message.startswith(says) and refused.value.hint
    assert refused.value.exit_code == ExitCode.INVALID_INPUT


def test_what_the_engine_does_not_say_is_not_checked() -> None:
    check_fault_target(7, 99, ranks=0, chunk_size=0, max_tokens=0)
    check_fault_target(None, 1, ranks=1, chunk_size=256, max_tokens=0)  # no prompt length: one window at least
    with pytest.raises(InvalidInput):
        check_fault_target(None, 2, ranks=1, chunk_size=256, max_tokens=0)
