"""The cases of reduce, gather, scatter, alltoall and alltoallv, run inside spawned ranks (see
``tests/collectives/test_rooted.py``): every rank builds every rank's input from one seed and
checks its result against NumPy (``ddlcore.kernels.reference``) itself; each case returns a
digest so the parent can compare what ranks should share."""

from __future__ import annotations

import numpy as np

from tests.collectives.matrix import (
    DTYPES,
    OPS,
    check_close,
    digest,
    few_simulator_threads,
    random_input,
)

COUNTS = [0, 1, 7, 13, 1009]
THIN_DTYPES = [np.float16, np.float32, np.int32]


def _splits(size: int, seed: int) -> np.ndarray:
    """Every rank's alltoallv send counts (row s: what rank s sends to each rank), with zeros."""
    rng = np.random.default_rng([seed, size])
    counts = rng.integers(0, 9, (size, size))
    counts[rng.random((size, size)) < 0.2] = 0
    return counts


def _reduce(comm, dtype, count: int, op: str, root: int, ring_equal: bool) -> str:
    from ddlcore.kernels import reference

    rank, size = comm.rank, comm.size
    xs = [random_input(dtype, count, r, 11, op) for r in range(size)]
    x = xs[rank].copy()
    case = f"reduce {np.dtype(dtype).name} {op} count={count} root={root}"
    got = comm.reduce(x, op=op, root=root)
    np.testing.assert_array_equal(x, xs[rank])  # the input is untouched
    # DDL_ALGO=ring: the same ring reduce-scatter as allreduce's, bit for bit
    every = comm.allreduce(x, op=op) if ring_equal else None
    if rank != root:
        assert got is None, case
        untouched = np.full(count, 3, dtype)
        assert comm.reduce(x, op=op, root=root, out=untouched) is None
        np.testing.assert_array_equal(untouched, np.full(count, 3, dtype))
        return ""
    check_close(got, reference.reduce_ref(xs, op), dtype, op, size, f"rank {rank}: {case}")
    out = np.empty(count, dtype)
    assert comm.reduce(x, op=op, root=root, out=out) is out
    assert digest(out) == digest(got), case
    if every is not None:
        assert digest(got) == digest(every), case
    return digest(got)


def _gather_scatter(comm, dtype, count: int, root: int) -> str:
    rank, size = comm.rank, comm.size
    xs = [random_input(dtype, count, r, 12, "sum") for r in range(size)]
    got = comm.gather(xs[rank], root=root)
    if rank == root:
        np.testing.assert_array_equal(got, np.concatenate(xs))
    else:
        assert got is None
    whole = random_input(dtype, size * count, 99, 13, "sum")
    # Non-roots pass out= (x None), or an x shaped like the root's, by turns.
    if rank == root:
        part = comm.scatter(whole.copy(), root=root)
    elif (rank + count) % 2:
        out = np.empty(count, dtype)
        part = comm.scatter(None, root=root, out=out)
        assert part is out
    else:
        part = comm.scatter(np.empty(size * count, dtype), root=root)
    np.testing.assert_array_equal(part, whole[rank * count : (rank + 1) * count])
    return digest(got) if got is not None else ""


def _alltoall(comm, dtype, count: int) -> None:
    rank, size = comm.rank, comm.size
    xs = [random_input(dtype, size * count, r, 14, "sum") for r in range(size)]
    got = comm.alltoall(xs[rank])
    want = np.concatenate([x[rank * count : (rank + 1) * count] for x in xs])
    np.testing.assert_array_equal(got, want)
    counts = _splits(size, count)
    send = counts[rank]
    ys = [random_input(dtype, int(counts[r].sum()), r, 15, "sum") for r in range(size)]
    at = [np.concatenate([[0], np.cumsum(counts[r])]) for r in range(size)]
    want = np.concatenate([ys[r][at[r][rank] : at[r][rank + 1]] for r in range(size)])
    np.testing.assert_array_equal(comm.alltoallv(ys[rank], send.tolist()), want)
    out = np.empty(want.size, dtype)
    assert comm.alltoallv(ys[rank], send, counts[:, rank], out=out) is out
    np.testing.assert_array_equal(out, want)


def run_rooted(rank: int, size: int, thin: bool = False, ring_equal: bool = False) -> dict:
    """Every case in one communicator; returns {case: digest} (roots' results only)."""
    import ddlcore

    digests: dict[str, str] = {}
    with ddlcore.init() as comm:
        assert (comm.rank, comm.size) == (rank, size)
        n = 0
        for dtype in THIN_DTYPES if thin else DTYPES:
            for count in COUNTS:
                for op in OPS if not thin or dtype is np.float32 else ["sum"]:
                    root, n = n % size, n + 1
                    case = f"reduce {np.dtype(dtype).name} {op} {count} {root}"
                    digests[case] = _reduce(comm, dtype, count, op, root, ring_equal)
                root = (count + n) % size
                case = f"gather {np.dtype(dtype).name} {count} {root}"
                digests[case] = _gather_scatter(comm, dtype, count, root)
                _alltoall(comm, dtype, count)
        for root in range(size):  # every root, a 2-D buffer
            x = random_input(np.float32, 6 * size, rank, root, "sum").reshape(2 * size, 3)
            got = comm.gather(x, root=root)
            assert got.shape == (2 * size * size, 3) if rank == root else got is None
            if rank == root:
                assert comm.scatter(x, root=root).shape == (2, 3)
            else:
                assert comm.scatter(None, root=root, out=np.empty((2, 3), np.float32)).shape
            digests[f"reduce 2-D root {root}"] = _reduce(
                comm, np.float64, 13, "sum", root, ring_equal
            )
        handles = [
            comm.reduce_async(np.full(3, rank + 1.0), root=size - 1),
            comm.gather_async(np.full(2, rank, np.int64), root=0),
            comm.scatter_async(np.arange(size * 2.0), root=0),
            comm.alltoall_async(np.full(size, rank, np.int8)),
            comm.alltoallv_async(np.full(size, rank, np.int8), [1] * size, [1] * size),
        ]
        red, gat, sca, a2a, a2av = (h.wait() for h in handles)
        if rank == size - 1:
            np.testing.assert_array_equal(red, np.full(3, size * (size + 1) / 2))
        if rank == 0:
            np.testing.assert_array_equal(gat, np.repeat(np.arange(size), 2))
        np.testing.assert_array_equal(sca, [2.0 * rank, 2.0 * rank + 1])
        np.testing.assert_array_equal(a2a, np.arange(size, dtype=np.int8))
        np.testing.assert_array_equal(a2av, np.arange(size, dtype=np.int8))
        last = comm.flight_record()["entries"][-5:]  # what DDL_FLIGHT_RECORDER would write
        assert [(e["collective"], e["root"], e["state"]) for e in last] == [
            ("reduce", size - 1, "completed"),
            ("gather", 0, "completed"),
            ("scatter", 0, "completed"),
            ("alltoall", None, "completed"),
            ("alltoallv", None, "completed"),
        ], last
        _bad_arguments(comm)
    return digests


def _bad_arguments(comm) -> None:
    """Wrong sizes and roots are ValueErrors naming the argument, before any communication."""
    import pytest

    size = comm.size
    with pytest.raises(ValueError, match="root=-1"):
        comm.reduce(np.ones(3), root=-1)
    with pytest.raises(ValueError, match=f"root={size}"):
        comm.gather(np.ones(3), root=size)
    with pytest.raises(TypeError, match="root must be an int"):
        comm.scatter(np.ones(size), root=0.5)
    if size > 1:
        with pytest.raises(ValueError, match="not divisible"):
            comm.alltoall(np.ones(size + 1))
        with pytest.raises(ValueError, match="out= "):
            comm.scatter(None, root=(comm.rank + 1) % size)
    with pytest.raises(ValueError, match="send_counts"):
        comm.alltoallv(np.ones(3), [1] * (size + 1))
    with pytest.raises(ValueError, match="add up to"):
        comm.alltoallv(np.ones(3), [4] + [0] * (size - 1), [4] + [0] * (size - 1))
    with pytest.raises(ValueError, match="out has"):
        comm.reduce(np.ones(3), root=0, out=np.ones(4))
    x = np.ones(2 * size)
    with pytest.raises(ValueError, match="cannot run in place"):
        comm.alltoall(x, out=x)
    with pytest.raises(ValueError, match="cannot run in place"):
        comm.alltoallv(x, [2] * size, [2] * size, out=x)
    with pytest.raises(ValueError, match="cannot run in place"):
        comm.scatter(x, root=comm.rank, out=x[:2])


def device_rooted(rank: int, size: int) -> bool:
    """The same collectives on (simulated) device arrays, through the device engine."""
    from ddlcore.kernels import reference
    from numba import cuda

    import ddlcore

    few_simulator_threads()
    with ddlcore.init() as comm:
        for dtype in (np.float32, np.int8, np.float64):
            for count in (0, 1, 13, 300):
                root = count % size
                for op in ("sum", "avg", "max"):
                    xs = [random_input(dtype, count, r, 21, op) for r in range(size)]
                    got = comm.reduce(cuda.to_device(xs[rank]), op=op, root=root)
                    if rank == root:
                        want = reference.reduce_ref(xs, op)
                        check_close(got.copy_to_host(), want, dtype, op, size, "device reduce")
                    else:
                        assert got is None
                xs = [random_input(dtype, size * count, r, 22, "sum") for r in range(size)]
                got = comm.gather(cuda.to_device(xs[rank][:count]), root=root)
                if rank == root:
                    want = np.concatenate([x[:count] for x in xs])
                    np.testing.assert_array_equal(got.copy_to_host(), want)
                out = cuda.to_device(np.empty(count, dtype))
                part = comm.scatter(cuda.to_device(xs[root]) if rank == root else None, root, out)
                block = xs[root][rank * count : (rank + 1) * count]
                np.testing.assert_array_equal(part.copy_to_host(), block)
                got = comm.alltoall(cuda.to_device(xs[rank])).copy_to_host()
                want = np.concatenate([x[rank * count : (rank + 1) * count] for x in xs])
                np.testing.assert_array_equal(got, want)
        assert comm._device_path.slots or size == 1  # the device engine ran them
    return True


def _mismatched(comm, case: str, odd: bool) -> None:
    """The call of ``case``: the ranks with ``odd`` set make the other one."""
    rank, size = comm.rank, comm.size
    x = np.arange(12 * size, dtype=np.float32) + rank + 1
    if case == "reduce root":
        comm.reduce(x, root=1 if odd else 0)
    elif case == "reduce op":
        comm.reduce(x, op="max" if odd else "sum")
    elif case == "gather vs reduce":
        comm.gather(x) if odd else comm.reduce(x)
    elif case == "scatter count":
        comm.scatter(
            x[: size * (5 if odd else 4)] if rank == 0 else None,
            out=np.empty(5 if odd else 4, np.float32),
        )
    elif case == "alltoall vs allreduce":
        comm.alltoall(x) if odd else comm.allreduce(x)
    elif case == "gather vs allgather":
        comm.gather(x) if odd else comm.allgather(x)
    elif case == "alltoallv splits":
        send = [3 if odd and j == (rank + 1) % size else 2 for j in range(size)]
        comm.alltoallv(x[: sum(send)], send, [2] * size)


MISMATCHES = [
    "reduce root",
    "reduce op",
    "gather vs reduce",
    "scatter count",
    "alltoall vs allreduce",
    "gather vs allgather",
    "alltoallv splits",
]


def mismatch_cases(rank: int, size: int) -> dict:
    """Each case on a new communicator (a mismatch breaks it); the last rank differs. Returns
    {case: (error class, message, seconds)}."""
    from tests.collectives.test_mismatch import outcome

    odd = rank == size - 1
    return {
        case: outcome(lambda comm, case=case: _mismatched(comm, case, odd)) for case in MISMATCHES
    }
