"""Schedules checked symbolically: every rank's steps are interpreted in one process with NumPy
(messages matched by (sender, receiver, slot)), and the result compared with the reference.

This proves the algorithms (segmenting, chunking, slot matching, ordering, no deadlock) for many
world sizes and counts without spawning a process; the multi-process tests then prove the engine
and transports run them.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest

from ddlcore import topology
from ddlcore.algorithms import (
    ALGORITHMS,
    Buf,
    Kind,
    chain,
    dissemination,
    halving_doubling,
    mdring,
    ring,
)
from ddlcore.algorithms.schedule import Schedule, split


def interpret(schedules: list[Schedule], inputs: list[np.ndarray], outputs: list[np.ndarray],
              reduce=np.add) -> None:
    """Run all ranks' schedules to completion, round-robin; fail on deadlock or mismatch."""
    size = len(schedules)
    queues: dict[tuple[int, int, int], deque] = {}
    pcs = [0] * size
    scratch = [np.zeros(max(s.scratch_count, 1), inputs[r].dtype) for r, s in enumerate(schedules)]

    def buf(rank, which):
        return {Buf.INPUT: inputs[rank], Buf.OUTPUT: outputs[rank], Buf.SCRATCH: scratch[rank]}[which]

    while any(pcs[r] < len(schedules[r].steps) for r in range(size)):
        progressed = False
        for r in range(size):
            steps = schedules[r].steps
            while pcs[r] < len(steps):
                s = steps[pcs[r]]
                if s.kind == Kind.SEND:
                    data = buf(r, s.src)[s.src_off:s.src_off + s.count].copy()
                    queues.setdefault((r, s.peer, s.slot), deque()).append(data)
                elif s.kind == Kind.COPY:
                    buf(r, s.dst)[s.dst_off:s.dst_off + s.count] = buf(r, s.src)[s.src_off:s.src_off + s.count]
                else:
                    q = queues.get((s.peer, r, s.slot))
                    if not q:
                        break
                    data = q.popleft()
                    assert data.size == s.count, f"rank {r} step {pcs[r]}: size mismatch"
                    dst = buf(r, s.dst)
                    if s.kind == Kind.RECV:
                        dst[s.dst_off:s.dst_off + s.count] = data
                    else:
                        lhs = buf(r, s.src)[s.src_off:s.src_off + s.count]
                        pair = (data, lhs) if s.staged_first else (lhs, data)
                        dst[s.dst_off:s.dst_off + s.count] = reduce(*pair)
                pcs[r] += 1
                progressed = True
        assert progressed, f"deadlock: program counters {pcs}"
    leftover = {k: len(q) for k, q in queues.items() if q}
    assert not leftover, f"messages never received: {leftover}"


SIZES = [1, 2, 3, 4, 5, 7, 8]
COUNTS = [0, 1, 2, 3, 7, 13, 64, 101]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("chunk_elems", [1, 3, 1000])
def test_ring_allreduce(size, count, chunk_elems):
    rng = np.random.default_rng(size * 1000 + count)
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
    outputs = [np.full(count, -7, np.int64) for _ in range(size)]
    scheds = [ring.allreduce(r, size, count, 8, chunk_elems * 8) for r in range(size)]
    interpret(scheds, inputs, outputs)
    expect = np.sum(inputs, axis=0)
    for r in range(size):
        np.testing.assert_array_equal(outputs[r], expect)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("k", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("chunk_elems", [1, 4, 1000])
def test_ring_reduce_scatter(size, k, chunk_elems):
    rng = np.random.default_rng(size * 100 + k)
    inputs = [rng.integers(-1000, 1000, size * k).astype(np.int64) for _ in range(size)]
    outputs = [np.full(k, -7, np.int64) for _ in range(size)]
    scheds = [ring.reduce_scatter(r, size, size * k, 8, chunk_elems * 8) for r in range(size)]
    interpret(scheds, inputs, outputs)
    total = np.sum(inputs, axis=0)
    for r in range(size):
        np.testing.assert_array_equal(outputs[r], total[r * k:(r + 1) * k])


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("k", [0, 1, 2, 5, 17])
@pytest.mark.parametrize("chunk_elems", [1, 4, 1000])
def test_ring_allgather(size, k, chunk_elems):
    rng = np.random.default_rng(size * 10 + k)
    inputs = [rng.integers(-1000, 1000, k).astype(np.int64) for _ in range(size)]
    outputs = [np.full(size * k, -7, np.int64) for _ in range(size)]
    scheds = [ring.allgather(r, size, k, 8, chunk_elems * 8) for r in range(size)]
    interpret(scheds, inputs, outputs)
    for r in range(size):
        np.testing.assert_array_equal(outputs[r], np.concatenate(inputs))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("count", [0, 1, 9, 100])
def test_chain_broadcast(size, count):
    for root in range(size):
        rng = np.random.default_rng(root)
        bufs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
        expect = bufs[root].copy()
        scheds = [chain.broadcast(r, size, count, 8, 3 * 8, root) for r in range(size)]
        interpret(scheds, bufs, bufs)
        for r in range(size):
            np.testing.assert_array_equal(bufs[r], expect)


@pytest.mark.parametrize("size", SIZES)
def test_dissemination_barrier_needs_everyone(size):
    """Every rank's last step must (transitively) depend on every other rank's first step."""
    scheds = [dissemination.barrier(r, size) for r in range(size)]
    heard = [{r} for r in range(size)]
    for rnd in range(len(scheds[0].steps) // 2):
        sent = [set(h) for h in heard]
        for r in range(size):
            recv = scheds[r].steps[2 * rnd + 1]
            heard[r] |= sent[recv.peer]
    assert all(h == set(range(size)) for h in heard)


def test_ring_allreduce_traffic_is_bandwidth_optimal():
    size, count = 4, 4000
    sched = ring.allreduce(0, size, count, 4, 400 * 4)
    sent = sum(s.count for s in sched.steps if s.kind == Kind.SEND)
    assert sent == 2 * (size - 1) * count // size


def test_split_is_even_and_covers():
    assert split(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert split(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]


def test_final_reduction_is_marked_once_per_region():
    size, count = 3, 30
    for r in range(size):
        fin = [s for s in ring.allreduce(r, size, count, 4, 40).steps if s.finalize]
        owned = split(count, size)[r]
        assert sum(s.count for s in fin) == owned[1]
        assert all(owned[0] <= s.dst_off < owned[0] + owned[1] for s in fin)


def test_registry_names_every_collective():
    assert set(ALGORITHMS) == {"allreduce", "reduce_scatter", "allgather", "broadcast", "barrier"}


def test_schedule_prints():
    text = str(ring.allreduce(0, 2, 8, 4, 16))
    assert "allreduce via ring" in text and "recv-red" in text and "final" in text


# --- every reduction algorithm over flat worlds and boxes ---------------------------------------

def _box(dims, order=None):
    topo = topology.box(dims, [1e9] * len(dims), [1e-6] * len(dims))
    if order is not None:
        topo = topology.Topology(topo.dims, tuple(order), topo.bw, topo.lat, topo.levels)
    return topo


BOXES = [(n,) for n in range(1, 10)] + [(2, 2), (2, 3), (3, 2), (2, 2, 2), (4, 2), (2, 4), (3, 3),
                                        (1, 4), (4, 1), (2, 1, 3), (3, 2, 2)]
# Ranks of a host interleaved (ranks 0, 2 on one host, 1, 3 on the other).
ODD_ORDERS = [((2, 2), (0, 2, 1, 3)), ((2, 3), (5, 0, 3, 1, 4, 2)), ((2, 2, 2), (7, 6, 5, 4, 3, 2, 1, 0))]
TOPOLOGIES = [_box(d) for d in BOXES] + [_box(d, o) for d, o in ODD_ORDERS]
REDUCTIONS = [(c, a) for c in ("allreduce", "reduce_scatter", "allgather") for a in ALGORITHMS[c]]


def _run(collective, algo, topo, count, chunk_elems, dtype=np.int64, reduce=np.add, seed=0):
    size = topo.size
    rng = np.random.default_rng([seed, size, count])
    n_in = size * count if collective == "reduce_scatter" else count
    n_out = size * count if collective == "allgather" else count
    if np.dtype(dtype).kind == "f":
        inputs = [rng.standard_normal(n_in).astype(dtype) for _ in range(size)]
    else:
        inputs = [rng.integers(-1000, 1000, n_in).astype(dtype) for _ in range(size)]
    outputs = [np.full(n_out, -7, dtype) for _ in range(size)]
    make = ALGORITHMS[collective][algo]
    isz = np.dtype(dtype).itemsize
    scheds = [make(r, size, n_in, isz, chunk_elems * isz, topo) for r in range(size)]
    assert all(s.algorithm == algo for s in scheds)
    interpret(scheds, inputs, outputs, reduce)
    return inputs, outputs


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}")
@pytest.mark.parametrize("collective,algo", REDUCTIONS)
@pytest.mark.parametrize("count", [0, 1, 2, 7, 101])
@pytest.mark.parametrize("chunk_elems", [1, 5, 1000])
def test_reduction_algorithms(collective, algo, topo, count, chunk_elems):
    inputs, outputs = _run(collective, algo, topo, count, chunk_elems)
    total = np.sum(inputs, axis=0)
    for r in range(topo.size):
        if collective == "allreduce":
            want = total
        elif collective == "reduce_scatter":
            want = total[r * count:(r + 1) * count]
        else:
            want = np.concatenate(inputs)
        np.testing.assert_array_equal(outputs[r], want, err_msg=f"rank {r}")


@pytest.mark.parametrize("topo", TOPOLOGIES, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}")
@pytest.mark.parametrize("algo", list(ALGORITHMS["allreduce"]))
@pytest.mark.parametrize("reduce", [np.add, np.minimum], ids=["sum", "min"])
def test_allreduce_is_bit_identical_on_every_rank(algo, topo, reduce):
    """Floating point sums in different orders differ; every rank must hold the same bits.
    (min of +0.0 and -0.0 depends on operand order: rd puts the lower rank first on both ends.)"""
    inputs, outputs = _run("allreduce", algo, topo, 37, 4, np.float32, reduce, seed=1)
    if reduce is np.minimum:
        for x in inputs:
            x[::3] = 0.0
            x[1::6] = -0.0
        inputs, outputs = _run("allreduce", algo, topo, 37, 4, np.float32, reduce, seed=1)
    for r in range(1, topo.size):
        assert outputs[r].tobytes() == outputs[0].tobytes(), f"rank {r} differs from rank 0"


def test_mdring_moves_less_over_the_slow_dimension():
    """4 x 2 box: per rank, 2 (4-1)/4 n elements inside the host and 2 (2-1)/2 n/4 = n/4 across
    hosts, against the flat ring's 2 (8-1)/8 n through each host boundary."""
    topo, n = _box((4, 2)), 8000
    for r in range(8):
        sched = mdring.allreduce(r, 8, n, 4, 1 << 20, topo)
        slow = sum(s.count for s in sched.steps
                   if s.kind == Kind.SEND and topo.dim_between(r, s.peer) == 1)
        fast = sum(s.count for s in sched.steps
                   if s.kind == Kind.SEND and topo.dim_between(r, s.peer) == 0)
        assert slow == n // 4
        assert fast == 2 * 3 * n // 4
    steps = len(mdring.allreduce(0, 8, 8, 4, 1 << 20, topo).steps)
    assert steps < len(ring.allreduce(0, 8, 8, 4, 1 << 20, topo).steps)


def test_mdring_dim_order_is_a_permutation():
    topo = _box((2, 3))
    with pytest.raises(ValueError, match="permutation"):
        mdring.allreduce(0, 6, 10, 4, 64, topo, dim_order=(0, 0))
    inputs = [np.arange(12) * (r + 1) for r in range(6)]
    outputs = [np.zeros(12, np.int64) for _ in range(6)]
    scheds = [mdring.allreduce(r, 6, 12, 8, 16, topo, dim_order=(1, 0)) for r in range(6)]
    interpret(scheds, inputs, outputs)
    for out in outputs:
        np.testing.assert_array_equal(out, np.sum(inputs, axis=0))


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6, 7, 8, 13])
def test_halving_doubling_step_counts(size):
    p2, extra = halving_doubling.virtual_shape(size)
    rounds = p2.bit_length() - 1
    sched = halving_doubling.allreduce(size - 1, size, 1000, 4, 1 << 20)
    exchanges = len({s.slot // 1000 for s in sched.steps if s.kind == Kind.SEND})
    assert exchanges <= 2 * rounds + 1
    rd = halving_doubling.allreduce_doubling(size - 1, size, 10, 4, 1 << 20)
    assert sum(1 for s in rd.steps if s.kind == Kind.SEND) == rounds + (1 if size - 1 < 2 * extra else 0)
