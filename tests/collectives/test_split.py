"""Communicator.split on real processes: colors and keys, None, groups of one, nested splits,
two splits in a row, collectives and send/recv on the children against NumPy, and closing the
parent before its children."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import mpiexec_path, require, run_ranks


def _check_collectives(sub, members):
    """``sub``'s collectives against NumPy, ``members`` its ranks' parent ranks in order."""
    assert sub.size == len(members)
    rng = [np.random.default_rng([7, m]) for m in members]
    xs = [r.standard_normal(1031).astype(np.float64) for r in rng]
    y = sub.allreduce(xs[sub.rank])
    np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-12)
    ints = [np.arange(1, 4 * sub.size + 1, dtype=np.int32) * (m + 1) for m in members]
    np.testing.assert_array_equal(
        sub.reduce_scatter(ints[sub.rank], op="max"),
        np.max(ints, axis=0).reshape(sub.size, 4)[sub.rank],
    )
    got = sub.allgather(np.array([members[sub.rank]], np.int64))
    assert got.tolist() == members
    b = np.array([members[sub.rank]] * 3, np.uint8)
    sub.broadcast(b, root=sub.size - 1)
    assert b.tolist() == [members[-1]] * 3
    sub.barrier()
    if sub.size > 1:  # send/recv around the child's ring, in its ranks
        nxt, prv = (sub.rank + 1) % sub.size, (sub.rank - 1) % sub.size
        h = sub.isend(np.array([members[sub.rank]], np.int64), nxt, tag=3)
        assert sub.recv(np.empty(1, np.int64), prv, tag=3).tolist() == [members[prv]]
        h.wait()


def _split_job(rank, size):
    import ddlcore

    comm = ddlcore.init()
    with pytest.raises(TypeError, match="color"):
        comm.split("red")
    with pytest.raises(TypeError, match="key"):
        comm.split(0, key=1.5)
    # Parity groups, ordered by descending parent rank (key = -rank).
    sub = comm.split(rank % 2, key=-rank)
    members = sorted((r for r in range(size) if r % 2 == rank % 2), reverse=True)
    assert sub.rank == members.index(rank)
    # The child's ranks share the world's CPUs: its links are priced as the world's.
    assert sub.size == 1 or sub.topology.bw[0] == comm.topology.bw[0]
    _check_collectives(sub, members)
    # Two splits in a row with the same colors: separate communicators, separate namespaces.
    again = comm.split(rank % 2)
    _check_collectives(again, sorted(r for r in range(size) if r % 2 == rank % 2))
    again.close()
    # None and negative colors (MPI_UNDEFINED) stay out; rank 0 alone in a group of one.
    lone = comm.split(None if rank == 1 else (-5 if rank == 2 else (0 if rank == 0 else 1)))
    if rank in (1, 2):
        assert lone is None
    else:
        expect = [0] if rank == 0 else [r for r in range(3, size)]
        _check_collectives(lone, expect)
        if rank == 0:  # a world of one splits too
            one = lone.split(4)
            assert (one.rank, one.size) == (0, 1)
            one.close()
        lone.close()
    # Nested: split the parity group by halves of its order.
    nested = sub.split(sub.rank // 2, key=sub.rank)
    halves = [m for i, m in enumerate(members) if i // 2 == sub.rank // 2]
    _check_collectives(nested, halves)
    # The parent collectives still run beside the children.
    np.testing.assert_array_equal(comm.allreduce(np.ones(5, np.int64)), size)
    # Closing the parent first: the children keep working, then close.
    comm.close()
    _check_collectives(sub, members)
    _check_collectives(nested, halves)
    nested.close()
    sub.close()
    return True


@pytest.mark.parametrize(("transport", "nprocs"), [("shm", 4), ("tcp", 3)])
def test_split(transport, nprocs):
    env = {"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "20"}
    assert run_ranks(_split_job, nprocs, env=env, timeout=120) == [True] * nprocs


def _mpi_split_job(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        sub = comm.split(rank // 2)
        _check_collectives(sub, [r for r in range(size) if r // 2 == rank // 2])
        sub.close()
    return True


def test_split_mpi():
    """Under DDL_TRANSPORT=mpi the children talk tcp/shm (their contexts cannot duplicate
    MPI_COMM_WORLD on a subset of its ranks)."""
    require(mpiexec_path() is not None, "mpiexec is not installed")
    env = {"DDL_TRANSPORT": "mpi", "DDL_TIMEOUT": "20"}
    assert run_ranks(_mpi_split_job, 4, env=env, timeout=120, launcher="mpiexec") == [True] * 4
