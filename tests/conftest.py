"""Test-suite wide settings. Multi-rank helpers live in ``tests/harness.py``."""

from collections.abc import Iterator

import pytest

from tests.harness import RankPools, start_fork_server


@pytest.fixture(scope="session", autouse=True)
def fork_server() -> None:
    """Rank processes fork from one server (tests/harness.py), started before any test runs."""
    start_fork_server()


@pytest.fixture(scope="module")
def pools() -> Iterator[RankPools]:
    """Rank processes the module's tests share (`RankPools`): for tests whose subject is not
    the processes themselves; closed when the module's tests are done."""
    kept = RankPools()
    try:
        yield kept
    finally:
        kept.close()
