"""Integer avg is the exact mean rounded down (floor), never a wrapped sum divided: at the limits
of every integer type, on every path (the boards, each schedule algorithm over shm and TCP, the
host-staged mdring, device buffers on Numba's simulator), allreduce and reduce_scatter, in and out
of place, at 2 and 3 ranks (and 4 for the host-staged path), identical on every rank."""

from __future__ import annotations

import numpy as np
import pytest

from tests.collectives import matrix
from tests.harness import require

INT_DTYPES = [np.int8, np.uint8, np.int32, np.int64]
SMALL_MAX = 1 << 18  # hostcoll.SMALL_MAX: the boards' slots below, direct reads above
TIMEOUT_S = 30.0


def limit_input(dtype, count: int, rank: int) -> np.ndarray:
    """Values at and near the type's limits (and around zero), a different mix on each rank,
    then random values of the whole range: every sum of them wraps in the type itself."""
    info = np.iinfo(dtype)
    edges = [info.max, info.max - 1, info.min, info.min + 1, -1, 0, 1, 100, 101, 253, 254]
    edges = [v for v in edges if info.min <= v <= info.max]
    head = np.array(
        [edges[(j * (rank + 2) + rank) % len(edges)] for j in range(min(count, 64))], dtype
    )
    rest = matrix.random_input(dtype, count - head.size, rank, 11, "avg")
    return np.concatenate([head, rest])


def _cases(comm, rank, size, device=False):
    """Every integer dtype: allreduce at counts on both sides of the slots' size, and
    reduce_scatter (all but rd), in and out of place; returns the digests of the results."""
    to_dev = from_dev = lambda a: a  # noqa: E731
    if device:
        from numba import cuda

        to_dev, from_dev = cuda.to_device, lambda d: d.copy_to_host()
    algo = comm._algo
    out = {}
    for dtype in INT_DTYPES:
        isz = np.dtype(dtype).itemsize
        counts = [0, 1, 7, 1009] if device else [0, 1, 7, 1009, SMALL_MAX // isz + 3]
        for count in counts:
            xs = [limit_input(dtype, count, r) for r in range(size)]
            want = matrix.expected(xs, "avg")
            what = f"{algo} allreduce {np.dtype(dtype).name} avg count={count}"
            got = from_dev(comm.allreduce(to_dev(xs[rank]), op="avg"))
            np.testing.assert_array_equal(got, want, err_msg=what)
            mine = to_dev(xs[rank].copy())
            comm.allreduce(mine, op="avg", out=mine)
            np.testing.assert_array_equal(from_dev(mine), want, err_msg=what + " in place")
            out[what] = matrix.digest(got)
            if algo == "rd":
                continue
            xs = [limit_input(dtype, count * size, r) for r in range(size)]
            want = matrix.expected(xs, "avg")[rank * count : (rank + 1) * count]
            what = f"{algo} reduce_scatter {np.dtype(dtype).name} avg count={count}"
            got = from_dev(comm.reduce_scatter(to_dev(xs[rank]), op="avg"))
            np.testing.assert_array_equal(got, want, err_msg=what)
            out[what] = matrix.digest(comm.allgather(got))
    # the examples, stated plainly
    two = [np.array([100, -128, 127], np.int8), np.array([101, -127, -128], np.int8)]
    got = comm.allreduce(two[rank % 2], op="avg")
    if size == 2:
        assert got.tolist() == [100, -128, -1], got
    u = comm.allreduce(np.array([253 + rank % 2], np.uint8), op="avg")
    if size == 2:
        assert u.tolist() == [253], u
    return out


def _every_algorithm(rank, size, algos):
    import ddlcore

    digests = {}
    for algo in algos:
        with ddlcore.init(algo=algo) as comm:
            if algo == "auto":  # one host over shm: the boards
                assert comm.describe("allreduce", 1 << 20).algorithm == "direct"
            digests.update(_cases(comm, rank, size))
    return digests


@pytest.mark.parametrize("dtype", INT_DTYPES + [np.uint64])
def test_the_collective_tests_integer_mean_is_the_references(dtype):
    """`matrix.expected`'s 64-bit integer avg (what the collective tests check against) is
    `reference.avg_ref`'s exact mean in Python integers, at the limits, for 1 to 8 ranks."""
    from ddlcore.kernels import reference

    for n in range(1, 9):
        xs = [limit_input(dtype, 300, r) for r in range(n)]
        want = reference.avg_ref(xs)
        np.testing.assert_array_equal(matrix.expected(xs, "avg"), want, err_msg=f"{n} arrays")
        assert matrix.expected(xs, "avg").dtype == want.dtype


def _identical(results):
    assert all(r == results[0] for r in results[1:]), "ranks got different results"


@pytest.mark.parametrize("nprocs", [2, 3])
def test_int_avg_over_shm_every_algorithm(nprocs, pools):
    results = pools.run(
        _every_algorithm,
        nprocs,
        ("auto", "ring", "rhd", "rd", "mdring"),
        timeout=300,
        env={"DDL_TIMEOUT": str(TIMEOUT_S)},
    )
    _identical(results)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_int_avg_over_tcp(nprocs, pools):
    results = pools.run(
        _every_algorithm,
        nprocs,
        ("ring", "rhd", "rd"),
        timeout=300,
        env={"DDL_TRANSPORT": "tcp", "DDL_TIMEOUT": str(TIMEOUT_S)},
    )
    _identical(results)


def _host_staged(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        choice = comm.describe("allreduce", 16 << 20)
        assert choice.algorithm == "mdring" and choice.host_path == "direct", choice
        return _cases(comm, rank, size)


def test_int_avg_host_staged_mdring(pools):
    """Two "hosts" of two ranks (DDL_HOST_ID), a slow network: mdring through the boards."""
    envs = {r: {"DDL_HOST_ID": h} for r, h in enumerate("aabb")}
    results = pools.run(
        _host_staged,
        4,
        timeout=300,
        rank_envs=envs,
        env={"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6,1e-3", "DDL_TIMEOUT": str(TIMEOUT_S)},
    )
    _identical(results)


def _on_device(rank, size, algo):
    import ddlcore
    from tests.collectives.matrix import few_simulator_threads

    few_simulator_threads()
    with ddlcore.init(algo=algo) as comm:
        return _cases(comm, rank, size, device=True)


@pytest.mark.parametrize("nprocs,algo", [(2, "auto"), (3, "ring")])
def test_int_avg_device_arrays_on_the_simulator(nprocs, algo, pools):
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        require(False, "numba-cuda not installed (pip install 'ddlcore[cuda]')")
    results = pools.run(
        _on_device,
        nprocs,
        algo,
        timeout=300,
        env={"NUMBA_ENABLE_CUDASIM": "1", "DDL_TIMEOUT": str(TIMEOUT_S)},
    )
    _identical(results)
