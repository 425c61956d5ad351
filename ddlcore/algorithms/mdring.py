"""The multi-dimensional ring (PowerAI DDL, section 4.3): ring phases along each box dimension.

The ranks form a box d1 x d2 x ... x dk (`ddlcore.topology`), d1 the ranks sharing the fastest
link. The box comes from the hosts, not from rank numbers: where the launcher dealt ranks
round-robin over the hosts (ranks 0, 2 on one, 1, 3 on the other), ``Topology.order`` maps box
positions to ranks and every ring here runs along box coordinates, while reduce-scatter's and
allgather's blocks stay at their rank's offset. A box with one dimension is one ring in box order
(host by host), unlike ``ring``, which follows rank order.

Allreduce of n elements on a 4 x 2 box (4 ranks per host, 2 hosts)::

    RS along d1 (inside each host, 4-rank rings):  each rank keeps a reduced n/4
    RS along d2 (across hosts, 2-rank rings):      each rank keeps a fully reduced n/8  (final)
    AG along d2 (across hosts):                    each rank holds n/4
    AG along d1 (inside each host):                each rank holds n

Per rank, dimension j moves 2 (dj - 1)/dj x n/(d1...d(j-1)) elements, so the slowest links carry
only n/(d1...d(k-1)) and the latency is sum 2(dj - 1) steps instead of 2(P - 1). The last
dimension's reduce-scatter and allgather run as one ring program (`ring.ring_phase`), pipelined
chunk by chunk; every phase is the flat ring's program over a ring of ``dj`` ranks.

Pipelined across the dimensions (``segments`` > 1, chosen by the cost model for large
allreduces): the buffer in S segments, each run through every phase, a phase of one segment
overlapping the others' phases on other links (`_pipelined`; parts on streams, as schedule
data the engine, the device engine and the simulator all run). Sequential phases leave each
link idle while the others work; pipelined, after the first segment the busiest link alone sets
the pace: 1.10x the network bound on the paper's cluster (100 MB, 4x16x4) instead of 1.68x.

Each element is reduced once, by the rank that owns it at the end of the reduce-scatters, then
copied: results are bit-identical on every rank. Reduce-scatter and allgather need rank r's block
at position r of the output, but the phases split the buffer by box coordinates, dimension 1
first; so they work in a scratch buffer in that order, with one local copy of the blocks in (RS)
or out (AG). ``dim_order`` processes the dimensions in another order (the tuner may choose one).

Where ranks share hosts, the communicator runs the host dimensions through shared memory
instead of as rings (``ddlcore.execution.hostcoll``: each local rank reduces its part of the host's inputs
straight out of the others' buffers, and copies the others' final parts back at the end); the
``*_across_hosts`` schedules are then what runs between: the network dimensions' phases on that
part. For an allreduce the part is any 1/M of the buffer. For reduce-scatter and allgather it is
the blocks of the ranks at this rank's host position, one per network position
(`host_staged_blocks`)::

    reduce-scatter, 2 x 2 box (ranks a0 a1 on host a, b0 b1 on host b; block X of rank X):
      host phase (boards):  a0 keeps  A0 = a0+a1 summed over host a's inputs, for blocks a0, b0
      network RS (a0-b0):   a0 keeps  block a0 summed over all four inputs (b0: block b0)
    allgather: the network AG first (a0 and b0 swap blocks), then the boards spread the parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ddlcore.algorithms import ring
from ddlcore.algorithms.schedule import (
    Buf,
    Kind,
    Part,
    Schedule,
    Step,
    drop_empty,
    nchunks_for,
    split,
)
from ddlcore.collectives import Collective
from ddlcore.topology import Topology, flat

NAME = "mdring"


# Streams per link of a pipelined allreduce (whose rings have more than two ranks): with one,
# each ring step's latency leaves the link idle. A network adapter that several of the host's
# ranks share needs no second stream: their rings fill each other's gaps. Chosen in the
# simulator (BENCHMARKS.md, "The paper's cluster in the simulator").
CHANNELS = 2


def channels(d: int, shared: bool = False) -> int:
    """Streams of a pipelined allreduce along a dimension of ``d`` ranks (``shared``: over an
    adapter several ranks use): a ring of two takes one step each way, no chain of steps
    whose latencies a second stream could cover."""
    return 1 if shared or d <= 2 else CHANNELS


def active_dims(topo: Topology, dim_order: Sequence[int] | None = None) -> tuple[int, ...]:
    """The dimensions the phases run along, in order; dimensions of size 1 have no ring."""
    order = tuple(range(len(topo.dims))) if dim_order is None else tuple(dim_order)
    if sorted(order) != list(range(len(topo.dims))):
        raise ValueError(
            f"dim_order {order} is not a permutation of the box's {len(topo.dims)} dimensions"
        )
    return tuple(j for j in order if topo.dims[j] > 1)


def _phases(topo: Topology, rank: int, dims: Sequence[int], total: int):
    """For each dimension in ``dims``: (ring, position, segments, own region), where segments
    split the region that the previous phases left this rank."""
    coords = topo.coords(rank)
    region = (0, total)
    out = []
    for j in dims:
        d = topo.dims[j]
        segs = [(region[0] + off, length) for off, length in split(region[1], d)]
        out.append((topo.ring_along(rank, j), coords[j], segs))
        region = segs[coords[j]]
    return out


def _block_index(topo: Topology, rank: int, dims: Sequence[int]) -> int:
    """Where rank's block sits in the phase order (the first dimension most significant)."""
    coords = topo.coords(rank)
    index = 0
    for j in dims:
        index = index * topo.dims[j] + coords[j]
    return index


def allreduce(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology | None = None,
    dim_order: Sequence[int] | None = None,
    segments: int = 1,
) -> Schedule:
    """``segments`` > 1: pipelined across the dimensions in that many segments (`_pipelined`)."""
    topo = topo or flat(size)
    dims = active_dims(topo, dim_order)
    if len(dims) <= 1:
        return ring.ring_over(
            Collective.ALLREDUCE, topo.order, rank, count, itemsize, chunk_bytes, NAME
        )
    return _allreduce_along(rank, size, count, itemsize, chunk_bytes, topo, dims, segments)


def allreduce_across_hosts(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology,
    dim_order: Sequence[int] | None = None,
) -> Schedule:
    """The phases along the dimensions that leave the host, on ``count`` elements: the middle
    of an allreduce whose host dimensions run through shared memory (``ddlcore.execution.hostcoll``'s
    part reduce-scatter before it and part allgather after it). The rings keep this rank's
    host coordinates, so each carries the part this rank reduced inside its host."""
    return _allreduce_along(
        rank, size, count, itemsize, chunk_bytes, topo, _net_dims(topo, dim_order)
    )


def _net_dims(topo: Topology, dim_order: Sequence[int] | None) -> tuple[int, ...]:
    dims = tuple(j for j in active_dims(topo, dim_order) if j >= topo.host_dims)
    if not dims:
        raise ValueError(f"box {topo.shape} has no dimension across hosts")
    return dims


def host_staged_blocks(topo: Topology, dim_order: Sequence[int] | None = None) -> list[int]:
    """Where each rank's block sits (in blocks) in the buffer that the host phases of a
    reduce-scatter or allgather work on: local position ``l`` (0..M-1, as the host's boards
    number their ranks) major, then the rank's index along the network dimensions, in phase
    order (0..H-1). Local rank ``l``'s part of that buffer (blocks ``l*H`` .. ``l*H + H - 1``)
    is what its network phases carry."""
    dims, per_node = _net_dims(topo, dim_order), topo.ranks_per_node
    nets = topo.size // per_node
    return [
        topo.position(r) % per_node * nets + _block_index(topo, r, dims) for r in range(topo.size)
    ]


def reduce_scatter_across_hosts(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology,
    dim_order: Sequence[int] | None = None,
) -> Schedule:
    """The network dimensions' reduce-scatter of a reduce-scatter whose host dimensions ran on
    the boards: the input is this rank's part (``count`` = H x k elements, H blocks in the
    order of `host_staged_blocks`), summed over the host; the rings reduce it across hosts and
    this rank's own block (k elements) ends in the output (divided there, for avg)."""
    chunk = ring.chunk_elems(chunk_bytes, itemsize)
    steps = _reduce_scatter_phases(topo, rank, _net_dims(topo, dim_order), count, chunk, Buf.INPUT)
    return Schedule(
        Collective.REDUCE_SCATTER,
        NAME,
        rank,
        size,
        count,
        chunk,
        drop_empty(steps),
        scratch_count=count,
    )


def allgather_across_hosts(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology,
    dim_order: Sequence[int] | None = None,
) -> Schedule:
    """The network dimensions' allgather of an allgather whose host dimensions run on the
    boards after it: this rank's ``count`` = k input elements go to its place in the output,
    which holds H x k elements (this rank's part, in the order of `host_staged_blocks`), and
    the rings fill in the other ranks' blocks at this rank's host position."""
    dims = _net_dims(topo, dim_order)
    chunk = ring.chunk_elems(chunk_bytes, itemsize)
    total = count * (size // topo.ranks_per_node)
    steps = [
        Step(
            Kind.COPY,
            -1,
            0,
            count,
            Buf.INPUT,
            0,
            Buf.OUTPUT,
            _block_index(topo, rank, dims) * count,
        )
    ]
    steps += _allgather_phases(topo, rank, dims, total, chunk, Buf.OUTPUT)
    return Schedule(Collective.ALLGATHER, NAME, rank, size, count, chunk, drop_empty(steps))


def _reduce_scatter_phases(
    topo: Topology, rank: int, dims: Sequence[int], count: int, chunk: int, first_src: Buf
) -> list[Step]:
    """Reduce-scatter rings along ``dims`` on ``count`` elements in phase order: partial sums
    in the scratch buffer (the first phase takes this rank's contribution from ``first_src``),
    this rank's final block into the output."""
    steps: list[Step] = []
    slot = 0
    phases = _phases(topo, rank, dims, count)
    for i, (members, pos, segs) in enumerate(phases):
        last = i == len(phases) - 1
        nchunks = nchunks_for(segs[0][1], chunk)
        d = len(members)
        steps += ring.ring_phase(
            members,
            pos,
            segs,
            nchunks,
            d - 1,
            0,
            rs_src=first_src if i == 0 else Buf.SCRATCH,
            rs_dst=Buf.SCRATCH,
            final=(Buf.OUTPUT, 0) if last else None,
            finalize=last,
            slot_base=slot,
        )
        slot += ring.span_slots(d - 1, 0, nchunks)
    return steps


def _allgather_phases(
    topo: Topology, rank: int, dims: Sequence[int], total: int, chunk: int, buf: Buf
) -> list[Step]:
    """Allgather rings along ``dims`` in reverse, in place in ``buf`` (``total`` elements in
    phase order, this rank's block already at its place); slots as in allreduce."""
    steps: list[Step] = []
    plans, slot = [], 0
    for members, pos, segs in _phases(topo, rank, dims, total):
        nchunks = nchunks_for(segs[0][1], chunk)
        plans.append((members, pos, segs, nchunks, slot))
        slot += ring.span_slots(0, len(members) - 1, nchunks)
    for members, pos, segs, nchunks, base in reversed(plans):
        steps += ring.ring_phase(
            members, pos, segs, nchunks, 0, len(members) - 1, ag_buf=buf, slot_base=base
        )
    return steps


def _allreduce_phases(
    rank: int, count: int, chunk: int, topo: Topology, dims: Sequence[int]
) -> list[list[Step]]:
    """The allreduce's phases in order, each a list of steps: the reduce-scatters along
    ``dims[:-1]``, the last dimension's reduce-scatter and allgather as one ring program, then
    the allgathers in reverse."""
    # Slots: phase i's rings are its members' only shared history, so phase i's base counts
    # the slots of phases 0..i-1 (reduce-scatter and allgather of each reserved together).
    slot = 0
    plans, out = [], []
    phases = _phases(topo, rank, dims, count)
    for i, (members, pos, segs) in enumerate(phases):
        last = i == len(phases) - 1
        nchunks = nchunks_for(segs[0][1], chunk)
        d = len(members)
        out.append(
            ring.ring_phase(
                members,
                pos,
                segs,
                nchunks,
                d - 1,
                d - 1 if last else 0,
                rs_src=Buf.INPUT if i == 0 else Buf.OUTPUT,
                finalize=last,
                slot_base=slot,
            )
        )
        plans.append((members, pos, segs, nchunks, slot + ring.span_slots(d - 1, 0, nchunks)))
        slot += ring.span_slots(d - 1, d - 1, nchunks)
    for members, pos, segs, nchunks, ag_slot in reversed(plans[:-1]):
        out.append(
            ring.ring_phase(members, pos, segs, nchunks, 0, len(members) - 1, slot_base=ag_slot)
        )
    return out


def _allreduce_along(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology,
    dims: Sequence[int],
    segments: int = 1,
) -> Schedule:
    chunk = ring.chunk_elems(chunk_bytes, itemsize)
    if segments > 1 and count >= segments:
        steps, parts = _pipelined(rank, count, chunk, topo, dims, segments)
        return Schedule(
            Collective.ALLREDUCE, NAME, rank, size, count, chunk, drop_empty(steps), parts=parts
        )
    steps = [s for phase in _allreduce_phases(rank, count, chunk, topo, dims) for s in phase]
    return Schedule(Collective.ALLREDUCE, NAME, rank, size, count, chunk, drop_empty(steps))


def _pipelined(
    rank: int, count: int, chunk: int, topo: Topology, dims: Sequence[int], segments: int
) -> tuple[list[Step], tuple[Part, ...]]:
    """The allreduce in ``segments`` contiguous segments, each run through every phase, with
    the phases of different segments overlapping: phase i of segment s is a part on a stream
    of its link, after phase i-1 of segment s: a host dimension's (`channels` streams, segment
    s on channel s % channels, so that one segment's per-step latency is covered by the other's
    bytes), or the network adapters', whose streams every network dimension shares. Each
    stream takes its parts in wavefront order (phase i of segment s in wavefront s + i; the
    older segment first within one), and so does the program order: while the network carries
    segment s, the host links reduce segment s+1 and spread segment s-1::

        host   stream:  RS0  RS1  RS2 AG0  RS3 AG1  ...
        network stream:      N0   N1       N2       ...     (N = reduce-scatter + allgather)
    """
    k = len(dims)
    units: dict[tuple[int, int], list[Step]] = {}
    slot_base = 0
    for s, (off, length) in enumerate(split(count, segments)):
        phases = _allreduce_phases(rank, length, chunk, topo, dims)
        top = 0
        for i, phase in enumerate(phases):
            units[(s, i)] = [_moved(st, off, slot_base) for st in phase]
            top = max([top] + [st.slot + 1 for st in phase if st.kind != Kind.COPY])
        slot_base += top
    order = sorted(units, key=lambda u: (u[0] + u[1], u[0]))
    index = {u: p for p, u in enumerate(order)}
    shared = topo.ranks_per_node > topo.adapters
    net = max([channels(topo.dims[j], shared) for j in dims if j >= topo.host_dims] or [1])

    def stream(s: int, i: int) -> int:
        j = dims[i] if i < k else dims[2 * k - 2 - i]
        if j >= topo.host_dims:  # the network dimensions share the adapters' streams
            return topo.host_dims * CHANNELS + s % net
        return j * CHANNELS + s % channels(topo.dims[j])

    parts = tuple(Part(stream(s, i), (index[(s, i - 1)],) if i else ()) for s, i in order)
    steps = [dataclasses.replace(st, part=p) for p, u in enumerate(order) for st in units[u]]
    return steps, parts


def _moved(st: Step, offset: int, slot_base: int) -> Step:
    """``st`` of a segment's schedule, placed at element ``offset`` of the whole buffers, its
    slot after the earlier segments' (an allreduce uses the input and output only)."""
    return dataclasses.replace(
        st,
        src_off=st.src_off + offset,
        dst_off=st.dst_off + offset,
        slot=st.slot + slot_base if st.kind != Kind.COPY else st.slot,
    )


def reduce_scatter(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology | None = None,
    dim_order: Sequence[int] | None = None,
) -> Schedule:
    """``count`` = size * k; rank r ends with the reduced block r (k elements)."""
    topo = topo or flat(size)
    dims = active_dims(topo, dim_order)
    if len(dims) <= 1:
        return ring.ring_over(
            Collective.REDUCE_SCATTER, topo.order, rank, count, itemsize, chunk_bytes, NAME
        )
    chunk = ring.chunk_elems(chunk_bytes, itemsize)
    k = count // size
    # Blocks into scratch in phase order: phase j's segments are then contiguous.
    steps = [
        Step(Kind.COPY, -1, 0, k, Buf.INPUT, r * k, Buf.SCRATCH, _block_index(topo, r, dims) * k)
        for r in range(size)
    ]
    steps += _reduce_scatter_phases(topo, rank, dims, count, chunk, Buf.SCRATCH)
    return Schedule(
        Collective.REDUCE_SCATTER,
        NAME,
        rank,
        size,
        count,
        chunk,
        drop_empty(steps),
        scratch_count=count,
    )


def allgather(
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    topo: Topology | None = None,
    dim_order: Sequence[int] | None = None,
) -> Schedule:
    """``count`` = k; the output holds size * k elements, rank r's block at r * k."""
    topo = topo or flat(size)
    dims = active_dims(topo, dim_order)
    if len(dims) <= 1:
        return ring.ring_over(
            Collective.ALLGATHER, topo.order, rank, count, itemsize, chunk_bytes, NAME
        )
    chunk = ring.chunk_elems(chunk_bytes, itemsize)
    total = size * count
    mine = _block_index(topo, rank, dims) * count
    steps = [Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.SCRATCH, mine)]
    steps += _allgather_phases(topo, rank, dims, total, chunk, Buf.SCRATCH)
    steps += [
        Step(
            Kind.COPY,
            -1,
            0,
            count,
            Buf.SCRATCH,
            _block_index(topo, r, dims) * count,
            Buf.OUTPUT,
            r * count,
        )
        for r in range(size)
    ]
    return Schedule(
        Collective.ALLGATHER, NAME, rank, size, count, chunk, drop_empty(steps), scratch_count=total
    )
