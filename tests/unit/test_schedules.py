"""Schedules checked symbolically: every rank's steps are interpreted in one process with NumPy
(messages matched by (sender, receiver, slot)), and the result compared with the reference.

This proves the algorithms (segmenting, chunking, slot matching, ordering, no deadlock) for many
world sizes and counts without spawning a process; the multi-process tests then prove the engine
and transports run them.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

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
from ddlcore.algorithms.schedule import Schedule, Step, split
from ddlcore.collectives import Collective


def interpret(
    schedules: list[Schedule], inputs: list[np.ndarray], outputs: list[np.ndarray], reduce=np.add
) -> None:
    """Run all ranks' schedules to completion, round-robin; fail on deadlock or mismatch."""
    size = len(schedules)
    queues: dict[tuple[int, int, int], deque] = {}
    pcs = [0] * size
    scratch = [np.zeros(max(s.scratch_count, 1), inputs[r].dtype) for r, s in enumerate(schedules)]
    # Buf's values index each rank's (input, output, scratch): this loop runs millions of times.
    bufs = [(inputs[r], outputs[r], scratch[r]) for r in range(size)]
    assert (Buf.INPUT, Buf.OUTPUT, Buf.SCRATCH) == (0, 1, 2)

    def buf(rank, which):
        return bufs[rank][which]

    while any(pcs[r] < len(schedules[r].steps) for r in range(size)):
        progressed = False
        for r in range(size):
            steps = schedules[r].steps
            while pcs[r] < len(steps):
                s = steps[pcs[r]]
                if s.kind == Kind.SEND:
                    data = buf(r, s.src)[s.src_off : s.src_off + s.count].copy()
                    queues.setdefault((r, s.peer, s.slot), deque()).append(data)
                elif s.kind == Kind.COPY:
                    buf(r, s.dst)[s.dst_off : s.dst_off + s.count] = buf(r, s.src)[
                        s.src_off : s.src_off + s.count
                    ]
                else:
                    q = queues.get((s.peer, r, s.slot))
                    if not q:
                        break
                    data = q.popleft()
                    assert data.size == s.count, f"rank {r} step {pcs[r]}: size mismatch"
                    dst = buf(r, s.dst)
                    if s.kind == Kind.RECV:
                        dst[s.dst_off : s.dst_off + s.count] = data
                    else:
                        lhs = buf(r, s.src)[s.src_off : s.src_off + s.count]
                        pair = (data, lhs) if s.staged_first else (lhs, data)
                        dst[s.dst_off : s.dst_off + s.count] = reduce(*pair)
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
        np.testing.assert_array_equal(outputs[r], total[r * k : (r + 1) * k])


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


def test_with_slot_is_replace_for_every_field():
    # Every field away from its default, so a field with_slot forgot would show.
    values = {
        "kind": Kind.RECV_REDUCE,
        "src": Buf.SCRATCH,
        "dst": Buf.SCRATCH,
        "finalize": True,
        "staged_first": True,
    }
    fields = dataclasses.fields(Step)
    step = Step(**{f.name: values.get(f.name, 3 + i) for i, f in enumerate(fields)})
    assert step.with_slot(99) == dataclasses.replace(step, slot=99), "with_slot lost a field"


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
    assert set(ALGORITHMS) == set(Collective)


def test_schedule_prints():
    text = str(ring.allreduce(0, 2, 8, 4, 16))
    assert "allreduce via ring" in text and "recv-red" in text and "final" in text


# --- every reduction algorithm over flat worlds and boxes ---------------------------------------


def _box(dims, order=None):
    topo = topology.box(dims, [1e9] * len(dims), [1e-6] * len(dims))
    if order is not None:
        topo = topology.Topology(topo.dims, tuple(order), topo.bw, topo.lat, topo.levels)
    return topo


BOXES = [(n,) for n in range(1, 10)] + [
    (2, 2),
    (2, 3),
    (3, 2),
    (2, 2, 2),
    (4, 2),
    (2, 4),
    (3, 3),
    (1, 4),
    (4, 1),
    (2, 1, 3),
    (3, 2, 2),
]
# Ranks of a host interleaved (ranks 0, 2 on one host, 1, 3 on the other).
ODD_ORDERS = [
    ((2, 2), (0, 2, 1, 3)),
    ((2, 3), (5, 0, 3, 1, 4, 2)),
    ((2, 2, 2), (7, 6, 5, 4, 3, 2, 1, 0)),
]


def _placed(host_ids):
    """The box ``ddlcore.topology.build`` finds for ranks on these hosts (rank r on host_ids[r])."""
    return topology.build(host_ids, [""] * len(host_ids), {"host": "shm", "network": "tcp"}, {})


def _cyclic(per_host, hosts):
    """Ranks dealt round-robin over the hosts (Slurm --distribution=cyclic): rank r on r % H."""
    return _placed([f"h{r % hosts}" for r in range(per_host * hosts)])


# Cyclic placement: 2x2 (0,2,1,3), 2x3 (0,3,1,4,2,5), 3x2, 4x2; uneven hosts (3 + 2, a flat box in
# host order 0,2,4,1,3).
CYCLIC = [_cyclic(2, 2), _cyclic(2, 3), _cyclic(3, 2), _cyclic(4, 2), _placed(list("ababa"))]
TOPOLOGIES = [_box(d) for d in BOXES] + [_box(d, o) for d, o in ODD_ORDERS] + CYCLIC
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


@contextmanager
def case(what: str) -> Iterator[None]:
    """Name the case of a test that loops over several in its assertion's message."""
    try:
        yield
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}") from exc


@pytest.mark.parametrize(
    "topo", TOPOLOGIES, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
@pytest.mark.parametrize("collective,algo", REDUCTIONS)
def test_reduction_algorithms(collective, algo, topo):
    """Every count (0, 1, 2, 7, 101) x chunk size (1, 5, 1000 elements), in one test per
    (topology, collective, algorithm): pytest's cost per test outweighed the cases' own."""
    for count in (0, 1, 2, 7, 101):
        for chunk_elems in (1, 5, 1000):
            with case(f"count={count}, chunk of {chunk_elems} elements"):
                inputs, outputs = _run(collective, algo, topo, count, chunk_elems)
                total = np.sum(inputs, axis=0)
                for r in range(topo.size):
                    if collective == "allreduce":
                        want = total
                    elif collective == "reduce_scatter":
                        want = total[r * count : (r + 1) * count]
                    else:
                        want = np.concatenate(inputs)
                    np.testing.assert_array_equal(outputs[r], want, err_msg=f"rank {r}")


@pytest.mark.parametrize(
    "topo", TOPOLOGIES, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
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
        slow = sum(
            s.count for s in sched.steps if s.kind == Kind.SEND and topo.dim_between(r, s.peer) == 1
        )
        fast = sum(
            s.count for s in sched.steps if s.kind == Kind.SEND and topo.dim_between(r, s.peer) == 0
        )
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
    assert sum(1 for s in rd.steps if s.kind == Kind.SEND) == rounds + (
        1 if size - 1 < 2 * extra else 0
    )


# --- cyclic placement: the ring in rank order, mdring along the hosts ----------------------------


def _peers(sched):
    return {s.peer for s in sched.steps if s.kind != Kind.COPY}


@pytest.mark.parametrize("topo", CYCLIC, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}")
@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_ring_follows_rank_order_whatever_the_placement(topo, collective):
    """DDL_ALGO=ring is the topology-oblivious ring: rank r talks to r - 1 and r + 1 only, and
    its schedule is the one it has with no topology at all."""
    p, make = topo.size, ALGORITHMS[collective]["ring"]
    for r in range(p):
        sched = make(r, p, 6 * p, 4, 64, topo)
        assert _peers(sched) == {(r - 1) % p, (r + 1) % p} - {r}
        assert sched.steps == make(r, p, 6 * p, 4, 64).steps


@pytest.mark.parametrize("collective", ["allreduce", "reduce_scatter", "allgather"])
def test_mdring_on_a_flat_box_is_the_ring_in_box_order(collective):
    """Uneven hosts placed cyclically (a, b, a, b, a): mdring's one ring goes host by host,
    0 -> 2 -> 4 -> 1 -> 3, crossing each host boundary once."""
    topo = _placed(list("ababa"))
    order = topo.order
    for pos, r in enumerate(order):
        sched = ALGORITHMS[collective]["mdring"](r, 5, 50, 4, 64, topo)
        assert sched.algorithm == "mdring"
        assert _peers(sched) == {order[pos - 1], order[(pos + 1) % 5]}


@pytest.mark.parametrize("per_host,hosts", [(2, 2), (2, 3), (4, 2)])
def test_mdring_on_cyclic_placement_keeps_bytes_off_the_network(per_host, hosts):
    """Per rank, mdring sends 2 (H-1)/H n/M across hosts whatever the placement; the rank-order
    ring on cyclic placement sends its whole 2 (P-1)/P n across hosts from every rank."""
    p, n = per_host * hosts, 720 * per_host * hosts
    cyclic = _cyclic(per_host, hosts)
    block = _placed([f"h{r // per_host}" for r in range(p)])

    def across(algo, topo, r):
        sched = ALGORITHMS["allreduce"][algo](r, p, n, 4, 1 << 20, topo)
        return sum(
            s.count for s in sched.steps if s.kind == Kind.SEND and topo.dim_between(r, s.peer) == 1
        )

    for r in range(p):
        assert (
            across("mdring", cyclic, r)
            == across("mdring", block, r)
            == 2 * (hosts - 1) * n // (hosts * per_host)
        )
        assert across("ring", cyclic, r) == 2 * (p - 1) * n // p
    # Host 0's link, all its ranks together: the ring's M flows against mdring's one share each.
    host0 = [r for r in range(p) if r % hosts == 0]
    ring_link = sum(across("ring", cyclic, r) for r in host0)
    md_link = sum(across("mdring", cyclic, r) for r in host0)
    assert ring_link * (hosts - 1) * p == md_link * (p - 1) * hosts * per_host


def test_cyclic_mdring_reduces_in_the_same_order_as_block():
    """The box, not the rank numbers, sets mdring's reduction order: relabelling the ranks
    (cyclic instead of block placement) gives the same bits, rank for rank of the same box
    position."""
    block, cyclic = _box((2, 3)), _cyclic(2, 3)
    rng = np.random.default_rng(3)
    by_position = [rng.standard_normal(101).astype(np.float32) for _ in range(6)]
    results = []
    for topo in (block, cyclic):
        inputs = [by_position[topo.position(r)] for r in range(6)]
        outputs = [np.zeros(101, np.float32) for _ in range(6)]
        interpret([mdring.allreduce(r, 6, 101, 4, 40, topo) for r in range(6)], inputs, outputs)
        results.append(outputs[0].tobytes())
        assert all(o.tobytes() == results[-1] for o in outputs)
    assert results[0] == results[1]


def _slow_network(topo):
    """``topo`` with 1 Gbit/s-like links across hosts, shm-like inside."""
    links = [(3e9, 20e-6) if lvl == "host" else (1.2e8, 60e-6) for lvl in topo.levels]
    return topology.Topology(
        topo.dims,
        topo.order,
        tuple(b for b, _ in links),
        tuple(t for _, t in links),
        topo.levels,
        topo.note,
    )


@pytest.mark.parametrize("per_host,hosts", [(2, 2), (2, 3), (4, 2)])
def test_cost_model_and_simulator_see_the_rank_order_ring_cross_hosts(per_host, hosts):
    """Cyclic placement: each host's M ranks all send out of it, so the rank-order ring takes
    M times as long as with block placement, mdring the same; auto takes mdring. The simulator
    runs the same schedules on the same rank -> host map and agrees with the cost model."""
    from ddlcore import simulate
    from ddlcore.planning import tuning

    p, n = per_host * hosts, 64 << 20
    cyclic = _slow_network(_cyclic(per_host, hosts))
    block = _slow_network(_placed([f"h{r // per_host}" for r in range(p)]))
    ring_c, ring_b = (tuning.predict("allreduce", "ring", t, n) for t in (cyclic, block))
    assert ring_c == pytest.approx(per_host * ring_b, rel=0.01)
    md_c, md_b = (tuning.predict("allreduce", "mdring", t, n) for t in (cyclic, block))
    assert md_c == pytest.approx(md_b, rel=1e-9)
    assert tuning.choose("allreduce", cyclic, n, "auto", 1 << 20).algorithm == "mdring"
    sim = simulate.simulate("allreduce", "ring", cyclic, n, reduce_bw=3e9)
    assert sim.time_s == pytest.approx(ring_c, rel=0.05)


def test_auto_keeps_uneven_cyclic_hosts_together():
    """A flat box cannot price the host boundaries: where the ranks are not in box order, auto
    prefers the ring in box order (mdring) to the rank-order ring at a tie; in rank order,
    mdring on one dimension is the ring and is not offered."""
    from ddlcore.planning import tuning

    cyclic, block = _placed(list("ababa")), _placed(list("aaabb"))
    assert tuning.choose("allreduce", cyclic, 64 << 20, "auto", 1 << 20).algorithm == "mdring"
    assert tuning.choose("allreduce", block, 64 << 20, "auto", 1 << 20).algorithm == "ring"
    assert "mdring" not in {c.algorithm for c in tuning.candidates("allreduce", block, 1e6)}


# Boxes with host and network dimensions, as `topology.build` finds them: block and cyclic
# placement, 3 ranks per host, and racks (two network dimensions).
def _box_levels(dims, levels):
    """A box with these levels (``DDL_TOPOLOGY`` can put two dimensions inside a host)."""
    topo = _box(dims)
    return topology.Topology(topo.dims, topo.order, topo.bw, topo.lat, tuple(levels))


def _racked(per_host, hosts, racks):
    host_ids = [f"h{r // per_host}" for r in range(per_host * hosts * racks)]
    rack_ids = [f"k{r // (per_host * hosts)}" for r in range(per_host * hosts * racks)]
    return topology.build(host_ids, rack_ids, {"host": "shm", "network": "tcp"}, {})


ACROSS = [
    _placed([f"h{r // m}" for r in range(m * h)]) for m, h in ((2, 2), (4, 2), (3, 2), (2, 3))
]
ACROSS += [_cyclic(2, 2), _cyclic(2, 3), _cyclic(4, 2), _racked(2, 2, 2)]
ACROSS_ALL = ACROSS + [_box_levels((2, 2, 2), ("host", "host", "network"))]


def _host_phase(topo, blocks, inputs, k, per_rank):
    """What the boards do for a host-staged reduce-scatter: each host's ranks sum their inputs,
    arranged in host-staged order, and local position l keeps part l (H blocks)."""
    m = topo.ranks_per_node
    nets = topo.size // m
    parts = {}
    for r in range(topo.size):
        host = [q for q in range(topo.size) if topo.node_of(q) == topo.node_of(r)]
        host.sort(key=topo.position)  # the boards' rank order: box position
        staged = [np.empty_like(inputs[q]) for q in host]
        for s, q in zip(staged, host, strict=True):
            for src in range(topo.size):
                s[blocks[src] * k : (blocks[src] + 1) * k] = inputs[q][src * k : (src + 1) * k]
        total = staged[0].copy()
        for s in staged[1:]:
            total = total + s
        lpos = topo.position(r) % m
        parts[r] = total[lpos * nets * k : (lpos + 1) * nets * k]
        assert per_rank is None or parts[r].size == per_rank
    return parts


@pytest.mark.parametrize(
    "topo", ACROSS_ALL, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
@pytest.mark.parametrize("k", [0, 1, 3, 13])
@pytest.mark.parametrize("chunk_elems", [1, 4, 1000])
def test_reduce_scatter_across_hosts_after_the_boards(topo, k, chunk_elems):
    """The host-staged reduce-scatter: the boards' part (modelled here), then the network
    rings give every rank exactly its own block of the sum, in every host-first order."""
    for order in _host_first_orders(topo):
        _check_reduce_scatter_across(topo, k, chunk_elems, order)


def _check_reduce_scatter_across(topo, k, chunk_elems, order):
    p = topo.size
    nets = p // topo.ranks_per_node
    rng = np.random.default_rng([p, k, chunk_elems])
    inputs = [rng.integers(-1000, 1000, p * k) for _ in range(p)]
    blocks = mdring.host_staged_blocks(topo, order)
    assert sorted(blocks) == list(range(p))
    parts = _host_phase(topo, blocks, inputs, k, nets * k)
    scheds = [
        mdring.reduce_scatter_across_hosts(r, p, nets * k, 8, chunk_elems * 8, topo, order)
        for r in range(p)
    ]
    outputs = [np.full(k, -7, np.int64) for _ in range(p)]
    interpret(scheds, [parts[r] for r in range(p)], outputs)
    total = np.sum(inputs, axis=0)
    for r in range(p):
        np.testing.assert_array_equal(outputs[r], total[r * k : (r + 1) * k], err_msg=f"rank {r}")
        # only the network dimensions: every peer is on another host
        assert all(topo.node_of(s.peer) != topo.node_of(r) for s in scheds[r].steps if s.peer >= 0)


@pytest.mark.parametrize(
    "topo", ACROSS_ALL, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
@pytest.mark.parametrize("k", [0, 1, 3, 13])
@pytest.mark.parametrize("chunk_elems", [1, 4, 1000])
def test_allgather_across_hosts_before_the_boards(topo, k, chunk_elems):
    """The host-staged allgather: the network rings fill each rank's part with the blocks of
    the ranks at its host position, so that the boards' allgather of the parts, read back in
    rank order, is the allgather; in every host-first order."""
    for order in _host_first_orders(topo):
        _check_allgather_across(topo, k, chunk_elems, order)


def _check_allgather_across(topo, k, chunk_elems, order):
    p, m = topo.size, topo.ranks_per_node
    nets = p // m
    rng = np.random.default_rng([p, k, chunk_elems, 1])
    inputs = [rng.integers(-1000, 1000, k) for _ in range(p)]
    scheds = [
        mdring.allgather_across_hosts(r, p, k, 8, chunk_elems * 8, topo, order) for r in range(p)
    ]
    parts = [np.full(nets * k, -7, np.int64) for _ in range(p)]
    interpret(scheds, inputs, parts)
    blocks = mdring.host_staged_blocks(topo, order)
    for r in range(p):
        host = sorted(
            (q for q in range(p) if topo.node_of(q) == topo.node_of(r)), key=topo.position
        )
        staged = np.concatenate([parts[q] for q in host])  # the boards' allgather
        out = np.concatenate([staged[blocks[q] * k : (blocks[q] + 1) * k] for q in range(p)])
        np.testing.assert_array_equal(out, np.concatenate(inputs), err_msg=f"rank {r}")


def test_host_staged_blocks_follow_the_placement():
    """Host position major, network position minor: with ranks dealt round-robin over the
    hosts that is rank order (no permutation); host by host it is not."""
    assert mdring.host_staged_blocks(_cyclic(2, 3)) == list(range(6))
    assert mdring.host_staged_blocks(_placed(list("aabb"))) == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="no dimension across hosts"):
        mdring.host_staged_blocks(_placed(list("aaaa")))


def test_host_staged_arrangement_copies_only_irregular_placements():
    """Cyclic: the blocks lie in host-staged order; host by host: one board call per network
    position on the caller's buffer (starting at that host's first rank) or a copy; otherwise
    a copy."""
    from ddlcore.execution.paths import host_staged

    assert host_staged._arrangement(_cyclic(2, 3), None) == host_staged._Arrangement()
    block = host_staged._arrangement(_placed(list("aaabbb")), None)
    assert block.groups == (0, 3) and block.blocks == (0, 2, 4, 1, 3, 5)
    # a board call per network position where its sync points cost less than the copy
    assert not host_staged._per_position(block, 2, 64 << 10)
    assert host_staged._per_position(block, 2, 1 << 20)
    assert not host_staged._per_position(block, 64, 1 << 20)
    # network positions in phase order: the host in its rack first, then the rack
    assert host_staged._arrangement(_racked(2, 2, 2), None).groups == (0, 4, 2, 6)
    odd = host_staged._arrangement(_placed(list("abba")), None)
    assert odd.groups is None and odd.blocks == (0, 1, 3, 2)


def _host_first_orders(topo):
    import itertools

    from ddlcore.planning import tuning

    return [o for o in itertools.permutations(range(len(topo.dims))) if tuning.host_first(topo, o)]


@pytest.mark.parametrize(
    "topo", ACROSS_ALL, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
def test_across_hosts_schedules_are_the_network_tail_of_mdring(topo):
    """Message for message (kind, peer, slot, count), the network phases of a host-staged
    reduce-scatter or allgather are those of the whole mdring schedule: a host whose ranks run
    the schedule (no boards there) still matches a host on the boards. Every host-first order
    the tuner may pick, two host dimensions included."""
    p = topo.size
    nets = p // topo.ranks_per_node

    def across(sched, r):
        return [
            (s.kind, s.peer, s.slot, s.count)
            for s in sched.steps
            if s.peer >= 0 and topo.node_of(s.peer) != topo.node_of(r)
        ]

    for order in _host_first_orders(topo):
        for k, chunk in ((1, 8), (5, 8), (300, 64), (300, 1 << 20)):
            for r in range(p):
                full = mdring.reduce_scatter(r, p, p * k, 8, chunk, topo, order)
                tail = mdring.reduce_scatter_across_hosts(r, p, nets * k, 8, chunk, topo, order)
                assert across(full, r) == across(tail, r), (order, k, chunk, r)
                full = mdring.allgather(r, p, k, 8, chunk, topo, order)
                tail = mdring.allgather_across_hosts(r, p, k, 8, chunk, topo, order)
                assert across(full, r) == across(tail, r), (order, k, chunk, r)


# --- mdring pipelined across the dimensions (parts on streams) -----------------------------------


def interpret_streams(
    schedules: list[Schedule],
    inputs: list[np.ndarray],
    outputs: list[np.ndarray],
    seed: int,
    reduce=np.add,
) -> None:
    """Run every rank's streams as independent actors, a step at a time in a random order
    (a part starts once the parts it comes after are done); fail on deadlock or mismatch."""
    rng = np.random.default_rng(seed)
    queues: dict[tuple[int, int, int], deque] = {}
    actors = []  # (rank, [(part, steps) ...])
    for r, sched in enumerate(schedules):
        for parts in sched.streams().values():
            actors.append((r, [(p, list(sched.part_steps[p][1])) for p in parts]))
    at = [[0, 0] for _ in actors]  # (part index in the actor's list, step in the part)
    done = [set() for _ in schedules]

    def buf(rank, which):
        return {Buf.INPUT: inputs[rank], Buf.OUTPUT: outputs[rank]}[which]

    def try_step(a: int) -> bool:
        r, plist = actors[a]
        pi, si = at[a]
        if pi == len(plist):
            return False
        p, steps = plist[pi]
        parts = schedules[r].parts
        if si == 0 and parts and not all(q in done[r] for q in parts[p].after):
            return False
        if si < len(steps):
            s = steps[si]
            if s.kind == Kind.SEND:
                data = buf(r, s.src)[s.src_off : s.src_off + s.count].copy()
                queues.setdefault((r, s.peer, s.slot), deque()).append(data)
            else:
                q = queues.get((s.peer, r, s.slot))
                if not q:
                    return False
                data = q.popleft()
                assert data.size == s.count
                dst = buf(r, s.dst)
                if s.kind == Kind.RECV:
                    dst[s.dst_off : s.dst_off + s.count] = data
                else:
                    lhs = buf(r, s.src)[s.src_off : s.src_off + s.count]
                    dst[s.dst_off : s.dst_off + s.count] = reduce(lhs, data)
            at[a][1] += 1
        if at[a][1] == len(steps):
            done[r].add(p)
            at[a] = [pi + 1, 0]
        return True

    while any(at[a][0] < len(actors[a][1]) for a in range(len(actors))):
        order = rng.permutation(len(actors))
        assert any(try_step(int(a)) for a in order), f"deadlock: {at}"
    assert not any(queues.values()), "messages never received"


PIPELINED_BOXES = [b for b in TOPOLOGIES if len([d for d in b.dims if d > 1]) > 1]


@pytest.mark.parametrize(
    "topo", PIPELINED_BOXES, ids=lambda t: f"{t.shape}:{''.join(map(str, t.order))}"
)
@pytest.mark.parametrize("segments", [2, 3, 5])
@pytest.mark.parametrize("count", [0, 1, 2, 7, 101])
@pytest.mark.parametrize("chunk_elems", [1, 1000])
def test_pipelined_mdring_allreduce(topo, segments, count, chunk_elems):
    """The segments' phases overlap across the dimensions: correct run in program order (one
    stream) and with every stream an actor of its own, in random interleavings."""
    size = topo.size
    rng = np.random.default_rng([size, count, segments])
    inputs = [rng.integers(-1000, 1000, count).astype(np.int64) for _ in range(size)]
    scheds = [
        mdring.allreduce(r, size, count, 8, chunk_elems * 8, topo, segments=segments)
        for r in range(size)
    ]
    total = np.sum(inputs, axis=0) if count else np.zeros(0, np.int64)
    outputs = [np.full(count, -7, np.int64) for _ in range(size)]
    interpret(scheds, inputs, outputs)
    for r in range(size):
        np.testing.assert_array_equal(outputs[r], total, err_msg=f"rank {r}, program order")
    for seed in range(3):
        outputs = [np.full(count, -7, np.int64) for _ in range(size)]
        interpret_streams(scheds, inputs, outputs, seed)
        for r in range(size):
            np.testing.assert_array_equal(outputs[r], total, err_msg=f"rank {r}, streams")


def test_pipelined_mdring_structure():
    """Every part waits only for earlier parts; a host dimension has its streams, the network
    dimensions share the adapters' (one where the host's ranks share an adapter), `CHANNELS`
    where a ring has more than two ranks; float results are bit-identical on every rank (and
    close to the unpipelined schedule's, which sums in another order)."""
    railed = topology.box((4, 3), [1e9, 1e8], [1e-6, 1e-5], adapters=4)
    scheds = [mdring.allreduce(r, 12, 101, 8, 64, railed, segments=5) for r in range(12)]
    assert all(len(s.streams()) == 2 * mdring.CHANNELS for s in scheds)
    inputs = [np.arange(101, dtype=np.int64) * (r + 1) for r in range(12)]
    outputs = [np.zeros(101, np.int64) for _ in range(12)]
    interpret_streams(scheds, inputs, outputs, 7)
    for out in outputs:
        np.testing.assert_array_equal(out, np.arange(101) * 78)
    topo = _box((2, 3, 2))
    size, count, segments = topo.size, 1009, 4
    scheds = [mdring.allreduce(r, size, count, 4, 64, topo, segments=segments) for r in range(size)]
    for s in scheds:
        assert s.parts and all(q < p for p, part in enumerate(s.parts) for q in part.after)
        assert len(s.streams()) == 2  # rings of 2 on the host; the adapter shared: one each
        assert {st.part for st in s.steps} <= set(range(len(s.parts)))
        assert "stream" in str(s)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(size)]
    plain = [np.zeros(count, np.float32) for _ in range(size)]
    interpret([mdring.allreduce(r, size, count, 4, 64, topo) for r in range(size)], inputs, plain)
    for seed in range(2):
        outputs = [np.zeros(count, np.float32) for _ in range(size)]
        interpret_streams(scheds, inputs, outputs, seed)
        for r in range(size):
            assert outputs[r].tobytes() == outputs[0].tobytes(), f"rank {r} differs"
    np.testing.assert_allclose(outputs[0], plain[0], rtol=1e-5, atol=1e-5)
