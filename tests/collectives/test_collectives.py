"""Every collective x dtype x op x count (0, 1, primes, not divisible by np, many chunks) on
np = 1..4 real processes, against the NumPy reference, with identical results on every rank:
the full matrix over tcp and shm, a thin slice over ucx and mpi."""

from __future__ import annotations

import numpy as np
import pytest

from tests.collectives import matrix
from tests.harness import mpiexec_path, require, run_ranks

# 1 KiB chunks: every dtype's larger counts run in many chunks (65537 elements: 64-512 chunks;
# 4099: 5-33), the smaller in one or a few. 256-byte chunks cost 2.6x the CPU time for chunks
# that the engine handles no differently.
SMALL_CHUNKS = {"DDL_CHUNK_BYTES": "1024", "DDL_TIMEOUT": "60"}


def _mpi_ready() -> None:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        require(False, "mpi4py is not installed (pip install 'ddlcore[mpi]')")
    require(mpiexec_path() is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")


# The full matrix runs on the two execution paths of one host: the schedules over tcp (the
# engine; ucx and mpi run the same schedules) and the shared-memory boards over shm (hostcoll).
# ucx and mpi, which the conformance suite proves as transports, carry the thin slice at every
# world size. One rank has no pair to carry, so the others start at two. Each world runs every
# collective in one communicator (one spawn per world, not per collective).
FULL = [("tcp", n) for n in (1, 2, 3, 4)] + [("shm", n) for n in (2, 3, 4)]
THIN = [(name, n) for name in ("ucx", "mpi") for n in (2, 3, 4)]


def _transport_ready(name: str) -> None:
    if name == "mpi":
        _mpi_ready()
        return
    from ddlcore import transports

    require(*transports.load(name).is_available())


# A full world does what four jobs of one collective each did (240 s deadline each); on a loaded
# 2-core machine that takes minutes (tcp-3: 106 s at load 15), so its deadline is wider.
FULL_TIMEOUT_S = 560


def _check_world(transport: str, nprocs: int, thin: bool) -> None:
    env = {**SMALL_CHUNKS, "DDL_TRANSPORT": transport}
    _transport_ready(transport)
    results = run_ranks(
        matrix.run_matrix,
        nprocs,
        matrix.COLLECTIVES,
        0,
        thin,
        env=env,
        timeout=240 if thin else FULL_TIMEOUT_S,
        launcher="mpiexec" if transport == "mpi" else "spawn",
    )
    for collective in matrix.COLLECTIVES:
        cases = [case for case in results[0] if case.startswith(collective + " ")]
        assert len(cases) > (20 if thin else 50), f"{collective}: only {len(cases)} cases ran"
    for rank in range(1, nprocs):
        # reduce_scatter: each rank holds a different block, each checked against the oracle
        differ = [
            case
            for case in results[0]
            if not case.startswith("reduce_scatter") and results[rank][case] != results[0][case]
        ]
        assert not differ, f"rank {rank} differs from rank 0 in {differ[:5]}"


@pytest.mark.slow
@pytest.mark.timeout(FULL_TIMEOUT_S + 40)
@pytest.mark.parametrize("transport,nprocs", FULL)
def test_matrix(transport, nprocs):
    _check_world(transport, nprocs, thin=False)


@pytest.mark.parametrize("transport,nprocs", THIN)
def test_matrix_thin_slice(transport, nprocs):
    _check_world(transport, nprocs, thin=True)


def _large(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        n = 3_000_001  # ~12 MB of float32: many 1 MiB chunks per segment at the default size
        x = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
        xs = [np.random.default_rng(r).standard_normal(n).astype(np.float32) for r in range(size)]
        y = comm.allreduce(x)
        np.testing.assert_allclose(y, np.sum(xs, axis=0, dtype=np.float64), rtol=1e-4, atol=1e-4)
        comm.allreduce(x, op="avg", out=x)
        np.testing.assert_allclose(x, np.mean(xs, axis=0, dtype=np.float64), rtol=1e-4, atol=1e-5)
        # every rank moves a part of a large broadcast, in many chunks: each part lands whole
        b = xs[size - 1].copy() if rank == size - 1 else np.full(n, np.nan, np.float32)
        comm.broadcast(b, root=size - 1)
        np.testing.assert_array_equal(b, xs[size - 1])
        return matrix.digest(y)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_large_default_chunks(nprocs):
    digests = run_ranks(_large, nprocs, timeout=120)
    assert len(set(digests)) == 1
