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


# The files that take longest on a 2-core machine (summed --durations of a whole run), longest
# first: they start first. pytest-xdist's `--dist loadfile` hands each worker whole files, and a
# long file handed out last runs alone while the other cores idle (its default order, most tests
# first, put the one-test torch trainings last: ~40 s of one idle core).
LONGEST_FILES = (
    "tests/integration/test_cli.py",
    "tests/integration/test_torch_backend.py",
    "tests/collectives/test_host_staged.py",
    "tests/unit/test_schedules.py",
    "tests/integration/test_launchers_real.py",
    "tests/collectives/test_device.py",
    "tests/collectives/test_collectives.py",
    "tests/collectives/test_algorithms.py",
    "tests/collectives/test_device_engine.py",
    "tests/integration/test_convergence.py",
    "tests/integration/test_launcher.py",
    "tests/integration/test_netns.py",
    "tests/transports/test_conformance.py",
    "tests/kernels/cuda/test_cuda_ptx.py",
    "tests/transports/test_mpi.py",
    "tests/integration/test_torch_train.py",
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist is installed
        config.option.loadscopereorder = False  # keep the order below


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first = {path: i for i, path in enumerate(LONGEST_FILES)}
    # A stable sort on the file alone: each file's tests stay together and in their order.
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))
