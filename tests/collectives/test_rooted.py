"""Reduce, gather, scatter, alltoall and alltoallv on np = 1..4 real processes against NumPy:
every dtype and op (reduce), every root, counts 0, 1, primes and not divisible by np, uneven
alltoallv splits with empty blocks, async handles and bad arguments. Over tcp (reduce checked
bit for bit against the ring allreduce) and shm (the boards compare the calls, the schedules run
them), a thin slice over mpi, and device arrays on Numba's simulator."""

from __future__ import annotations

import pytest

from tests.collectives import rooted_cases
from tests.collectives.test_collectives import _transport_ready
from tests.harness import require, run_ranks

SMALL_CHUNKS = {"DDL_CHUNK_BYTES": "256", "DDL_TIMEOUT": "60"}


def _check(pools, transport: str, nprocs: int, thin: bool = False, **env: str) -> None:
    _transport_ready(transport)
    ring_equal = env.get("DDL_ALGO") == "ring"
    env = {**SMALL_CHUNKS, "DDL_TRANSPORT": transport, **env}
    args = (rooted_cases.run_rooted, nprocs, thin, ring_equal)
    if transport == "mpi":
        results = run_ranks(*args, env=env, timeout=240, launcher="mpiexec")
    else:
        results = pools.run(*args, env=env, timeout=240)
    assert len(results[0]) > (10 if thin else 100)
    for case in results[0]:  # each root's result, as that root computed it
        roots = [r[case] for r in results if r[case]]
        assert len(roots) == 1 or not results[0][case] and not any(roots), case


@pytest.mark.parametrize("nprocs", [1, 2, 3, 4])
def test_tcp(nprocs, pools):
    _check(pools, "tcp", nprocs, DDL_ALGO="ring")


@pytest.mark.parametrize("nprocs", [2, 4])
def test_shm_through_the_boards_sync(nprocs, pools):
    _check(pools, "shm", nprocs)


def test_mpi_thin_slice(pools):
    _check(pools, "mpi", 3, thin=True)


def test_device_arrays_on_the_simulator(pools):
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        require(False, "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    env = {"NUMBA_ENABLE_CUDASIM": "1", "DDL_TRANSPORT": "tcp", **SMALL_CHUNKS}
    assert pools.run(rooted_cases.device_rooted, 3, env=env, timeout=240) == [True] * 3


@pytest.mark.parametrize("transport,nprocs", [("tcp", 3), ("shm", 2), ("shm", 4), ("mpi", 2)])
def test_mismatched_calls_raise_on_every_rank(transport, nprocs, pools):
    """Another root, op, count, split or collective on one rank: CollectiveMismatchError on
    every rank, well within DDL_TIMEOUT (the boards compare the calls on one host; the check
    words, or over MPI the explicit agreement, elsewhere)."""
    _transport_ready(transport)
    env = {"DDL_TIMEOUT": "20", "DDL_CHUNK_BYTES": "1024", "DDL_TRANSPORT": transport}
    if transport == "mpi":
        results = run_ranks(
            rooted_cases.mismatch_cases, nprocs, env=env, timeout=240, launcher="mpiexec"
        )
    else:
        results = pools.run(rooted_cases.mismatch_cases, nprocs, env=env, timeout=240)
    for rank, got in enumerate(results):
        for case, (cls, message, elapsed) in got.items():
            assert cls == "CollectiveMismatchError", f"rank {rank}, {case}: {cls}: {message}"
            assert elapsed < 10, f"rank {rank}, {case}: {elapsed:.1f} s: {message}"
