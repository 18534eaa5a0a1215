"""The fast lane: the runtime's unit tests over in-memory fakes (tests/unit/fakes.py, the engine built over them in
tests/unit/fixtures.py). No Mooncake, no rank processes, no torch; every test here is marked ``fast``
(``./scripts/test --fast`` runs only these). Only pytest hooks and fixtures here: tests import helpers from
unit.fixtures and unit.fakes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from unit.fixtures import HANG_DEADLINE_S, KV_TOKENS, FakeEngine, build_engine


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/unit/" in str(item.path).replace("\\", "/"):
            item.add_marker(pytest.mark.fast)
            item.add_marker(pytest.mark.timeout(30))


@pytest.fixture
def fake_engine() -> Iterator[FakeEngine]:
    eng = build_engine()
    try:
        yield eng
    finally:
        for r in eng.ranks:
            r.close()


@pytest.fixture
def kv_engine(request: pytest.FixtureRequest) -> Iterator[FakeEngine]:
    """An engine whose destination KV one request can fill (unit.fixtures.hold_blocks); parametrize indirectly to
    pass build_engine more options."""
    eng = build_engine(kv_tokens=KV_TOKENS, call_timeout_s=HANG_DEADLINE_S, **getattr(request, "param", {}))
    try:
        yield eng
    finally:
        eng.ranks[0].release.set()
        for r in eng.ranks:
            r.close()
