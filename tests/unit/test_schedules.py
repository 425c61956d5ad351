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

from ddlcore.algorithms import ALGORITHMS, Buf, Kind, chain, dissemination, ring
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
                        dst[s.dst_off:s.dst_off + s.count] = reduce(lhs, data)
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
