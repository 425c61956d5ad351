"""The schedules of reduce, gather, scatter, alltoall and alltoallv, run symbolically for every
rank (``test_schedules.interpret``), with and without the agreement's messages added: every
world size, root, count (0, 1, primes, not divisible by size) and chunking."""

from __future__ import annotations

import numpy as np
import pytest

from ddlcore.algorithms import agreement, alltoall, ring, rooted
from ddlcore.collectives import Collective
from tests.unit.test_schedules import interpret

SIZES = [1, 2, 3, 4, 5, 8]
COUNTS = [0, 1, 2, 7, 13, 101]


def _agreed(make, size, collective, count):
    complete = agreement.natural_completeness(collective, count, size)
    return [agreement.agreed(make, r, size, complete) for r in range(size)]


def _inputs(size, count, seed):
    rng = np.random.default_rng([seed, size, count])
    return [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("chunk_elems", [1, 3, 1000])
def test_reduce_equals_the_ring_allreduce_on_the_root(size, count, chunk_elems):
    xs = _inputs(size, count, 1)
    ring_out = [np.full(count, -7, np.int64) for _ in range(size)]
    interpret(
        [ring.allreduce(r, size, count, 8, chunk_elems * 8) for r in range(size)], xs, ring_out
    )
    for root in range(size):
        outs = [np.full(count, -7, np.int64) for _ in range(size)]

        def make(r, root=root):
            return rooted.reduce(r, size, count, 8, chunk_elems * 8, root)

        interpret(_agreed(make, size, Collective.REDUCE, count), xs, outs)
        np.testing.assert_array_equal(outs[root], np.sum(xs, axis=0))
        np.testing.assert_array_equal(outs[root], ring_out[root])
        for r in range(size):  # the others' outputs are never written
            if r != root:
                np.testing.assert_array_equal(outs[r], np.full(count, -7))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("k", [0, 1, 5, 17])
def test_gather_and_scatter(size, k):
    xs = _inputs(size, k, 2)
    for root in range(size):
        outs = [np.full(size * k, -7, np.int64) for _ in range(size)]
        scheds = _agreed(
            lambda r, root=root: rooted.gather(r, size, k, 8, 3 * 8, root), size, "gather", k
        )
        interpret(scheds, xs, outs)
        np.testing.assert_array_equal(outs[root], np.concatenate(xs))
        whole = _inputs(1, size * k, 3)[0]
        ins = [whole if r == root else np.full(size * k, -9, np.int64) for r in range(size)]
        outs = [np.full(k, -7, np.int64) for _ in range(size)]
        scheds = _agreed(
            lambda r, root=root: rooted.scatter(r, size, k, 8, 3 * 8, root), size, "scatter", k
        )
        interpret(scheds, ins, outs)
        for r in range(size):
            np.testing.assert_array_equal(outs[r], whole[r * k : (r + 1) * k])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("k", [0, 1, 5, 17])
def test_alltoall(size, k):
    xs = _inputs(size, size * k, 4)
    outs = [np.full(size * k, -7, np.int64) for _ in range(size)]
    scheds = _agreed(
        lambda r: alltoall.alltoall(r, size, size * k, 8, 4 * 8), size, "alltoall", size * k
    )
    interpret(scheds, xs, outs)
    for r in range(size):
        want = np.concatenate([x[r * k : (r + 1) * k] for x in xs])
        np.testing.assert_array_equal(outs[r], want)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_alltoallv_uneven_splits(size, seed):
    rng = np.random.default_rng([seed, size])
    counts = rng.integers(0, 6, (size, size))  # counts[s, d]: rank s sends to rank d
    xs = [_inputs(1, int(counts[s].sum()), s)[0] for s in range(size)]
    outs = [np.full(int(counts[:, d].sum()), -7, np.int64) for d in range(size)]

    def make(r):
        return alltoall.alltoallv(r, size, counts[r].tolist(), counts[:, r].tolist(), 8, 2 * 8)

    interpret(_agreed(make, size, "alltoallv", 0), xs, outs)
    at = [np.concatenate([[0], np.cumsum(counts[s])]) for s in range(size)]
    for d in range(size):
        want = [xs[s][at[s][d] : at[s][d + 1]] for s in range(size)]
        np.testing.assert_array_equal(outs[d], np.concatenate(want))


def test_the_simulator_runs_them_on_a_box():
    """The same schedules, agreement included, through the simulator's link model (4 hosts
    of 2 ranks): no deadlock, no lost message, a time between the latency and a second."""
    from ddlcore import topology
    from ddlcore.simulate.model import execute
    from ddlcore.simulate.program import Program

    topo = topology.box((2, 4), [50e9, 10e9], [2e-6, 10e-6])
    size, n = topo.size, 1 << 16
    counts = [[(s + d) % 3 * n for d in range(size)] for s in range(size)]
    makers = {
        "reduce": lambda r: rooted.reduce(r, size, n * size, 4, 1 << 16, 3),
        "gather": lambda r: rooted.gather(r, size, n, 4, 1 << 16, 5),
        "scatter": lambda r: rooted.scatter(r, size, n, 4, 1 << 16, 0),
        "alltoall": lambda r: alltoall.alltoall(r, size, n * size, 4, 1 << 16),
        "alltoallv": lambda r: alltoall.alltoallv(
            r, size, counts[r], [row[r] for row in counts], 4, 1 << 16
        ),
    }
    for collective, make in makers.items():
        count = n * size if collective in ("reduce", "alltoall") else n
        program = Program.from_schedules(_agreed(make, size, collective, count), size, 4, None, 1)
        time_s, finish, _ = execute(program, topo)
        assert 10e-6 < time_s < 1.0, (collective, time_s)
        assert len(finish) == size
