from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from bsr_cli.cli.main import run


@dataclass
class Result:
    code: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


@pytest.fixture
def bsr(capsys: pytest.CaptureFixture[str]):
    """Run the real CLI entry point in-process (same error boundary, same output layer)."""

    def call(*args: str) -> Result:
        code = run(list(args))
        cap = capsys.readouterr()
        return Result(code, cap.out, cap.err)

    return call
