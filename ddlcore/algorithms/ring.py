"""Chunked, pipelined ring reduce-scatter, allgather and allreduce (allreduce = RS + AG).

The P ranks form a ring in RANK order, whatever the hosts: the topology-oblivious ring
(``DDL_ALGO=ring``), as MPI's and Gloo's rings are. Where the launcher placed ranks host by host
(block placement) it crosses each host boundary once; where it dealt them round-robin over the
hosts (cyclic: Slurm ``--distribution=cyclic``, ``mpiexec --map-by node``) every hop crosses
hosts. The ring in the topology's box order (host by host whatever the placement) is mdring on a
one-dimensional box (`ring_over`). The rank at ring position r sends to position r+1 and
receives from r-1. The buffer is cut into P segments (the first ``count % P`` one element
longer) and each segment into C chunks.
Below, "rank r" means ring position r; `ring_phase` is the same program over any ring of ranks,
which the multi-dimensional ring (``mdring``) runs once per box dimension.

Reduce-scatter, P-1 steps; at step s rank r sends segment r-s-1 and receives segment r-s-2,
reducing it with its own input, so after the last step it holds the full reduction of segment r::

    step 0:   send seg r-1 (own input)           recv seg r-2, reduce with own input
    step s:   send seg r-s-1 (just reduced)      recv seg r-s-2, reduce with own input
    step P-2: send seg r+1                       recv seg r, reduce: final (avg divides here)

Allgather, P-1 steps; at step s rank r sends segment r-s and receives segment r-s-1 in place::

    step 0:   send seg r (own)                   recv seg r-1 -> output
    step s:   send seg r-s (just received)       recv seg r-s-1 -> output

Each rank sends and receives (P-1)/P of the buffer per phase: allreduce moves 2(P-1)/P * n bytes
per rank in 2(P-1) latency steps, the bandwidth optimum for a flat ring.

Pipelining: a step of chunk c only depends on the previous step of the same chunk, so steps are
emitted in wavefronts (step g of chunk c in wavefront g+c). While chunk c is reduced, chunk c+1
is on the wire. Every rank emits in the same order, so messages arrive in the order they are
consumed.
"""

from __future__ import annotations

from collections.abc import Sequence

from ddlcore.algorithms.schedule import (
    Buf,
    Kind,
    Schedule,
    Step,
    chunks_of,
    drop_empty,
    nchunks_for,
    split,
)
from ddlcore.collectives import Collective
from ddlcore.topology import Topology

NAME = "ring"


def ring_phase(
    ring: Sequence[int],
    pos: int,
    segs: Sequence[tuple[int, int]],
    nchunks: int,
    rs_steps: int,
    ag_steps: int,
    *,
    rs_src: Buf = Buf.INPUT,
    rs_dst: Buf = Buf.OUTPUT,
    final: tuple[Buf, int] | None = None,
    finalize: bool = True,
    ag_buf: Buf = Buf.OUTPUT,
    ag_first_src: tuple[Buf, int] | None = None,
    slot_base: int = 0,
) -> list[Step]:
    """Steps of the member at ``pos`` of ``ring`` for ``rs_steps`` reduce-scatter then
    ``ag_steps`` allgather steps over the segments ``segs`` (one per ring position).

    ``segs`` are (offset, length) in the full-size buffers. The reduce-scatter reads its own
    contribution from ``rs_src`` and writes partial reductions to ``rs_dst`` at the segment's
    offsets; when it ends the phase (no allgather follows), the final reduction of the own
    segment goes to ``final`` = (buffer, offset of the segment there), default in place in
    ``rs_dst``, and is marked ``finalize`` if asked. The allgather works in place in ``ag_buf``;
    with no reduce-scatter before it, its first send comes from ``ag_first_src`` (default: the
    own segment in ``ag_buf``). Slots are ``slot_base`` .. ``slot_base + span_slots(...) - 1``.
    """
    size = len(ring)
    nxt, prv = ring[(pos + 1) % size], ring[(pos - 1) % size]
    total = rs_steps + ag_steps
    chunked = [chunks_of(off, length, nchunks) for off, length in segs]

    def rs_seg(s: int, sending: bool) -> int:
        return (pos - s - (1 if sending else 2)) % size

    def ag_seg(s: int, sending: bool) -> int:
        return (pos - s - (0 if sending else 1)) % size

    # Where the data of global step g, chunk c lives after this rank received it.
    def recv_place(g: int, c: int) -> tuple[Buf, int, int]:
        if g < rs_steps:
            seg = rs_seg(g, False)
            off, cnt = chunked[seg][c]
            if g == rs_steps - 1 and ag_steps == 0 and final is not None:
                return final[0], final[1] + off - segs[seg][0], cnt
            return rs_dst, off, cnt
        seg = ag_seg(g - rs_steps, False)
        off, cnt = chunked[seg][c]
        return ag_buf, off, cnt

    def first_send(c: int) -> Step:
        if rs_steps:
            off, cnt = chunked[rs_seg(0, True)][c]
            return Step(Kind.SEND, nxt, slot_base + c, cnt, rs_src, off)
        off, cnt = chunked[pos][c]
        if ag_first_src is None:
            return Step(Kind.SEND, nxt, slot_base + c, cnt, ag_buf, off)
        return Step(
            Kind.SEND,
            nxt,
            slot_base + c,
            cnt,
            ag_first_src[0],
            ag_first_src[1] + off - segs[pos][0],
        )

    def unit(g: int, c: int) -> list[Step]:
        slot = slot_base + g * nchunks + c
        buf, off, cnt = recv_place(g, c)
        if g < rs_steps:
            in_off = chunked[rs_seg(g, False)][c][0]
            op = Step(
                Kind.RECV_REDUCE,
                prv,
                slot,
                cnt,
                rs_src,
                in_off,
                buf,
                off,
                finalize=finalize and g == rs_steps - 1,
            )
        else:
            op = Step(Kind.RECV, prv, slot, cnt, dst=buf, dst_off=off)
        out = [op]
        if g + 1 < total:
            out.append(Step(Kind.SEND, nxt, slot + nchunks, cnt, buf, off))
        return out

    # Within a wavefront the newest chunk goes first: chunk c+1's first send is emitted before
    # chunk c's receive-reduce, so it is on the wire while c is reduced (in the other order a
    # 2-rank ring, one step per phase, alternates transfer and reduction).
    steps: list[Step] = []
    for wave in range(total + nchunks):
        for c in range(min(nchunks - 1, wave), max(0, wave - total) - 1, -1):
            g = wave - 1 - c
            steps.extend([first_send(c)] if g < 0 else unit(g, c))
    return steps


def span_slots(rs_steps: int, ag_steps: int, nchunks: int) -> int:
    """How many slots one `ring_phase` uses (the next phase on the same pairs starts after)."""
    return (rs_steps + ag_steps + 1) * nchunks


def chunk_elems(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // max(1, itemsize))


def local_copy(
    collective: str, rank: int, count: int, chunk: int, dst_off: int = 0, algorithm: str = NAME
) -> Schedule:
    """A world of one: the result is the input (every algorithm's schedule for size 1)."""
    copy = (Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, dst_off),)
    return Schedule(collective, algorithm, rank, 1, count, chunk, drop_empty(copy))


def allreduce(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """The ring in rank order; ``topo`` (the registry's signature) does not change it."""
    return ring_over(Collective.ALLREDUCE, tuple(range(size)), rank, count, itemsize, chunk_bytes)


def reduce_scatter(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """``count`` is the input length (size * k); rank r's output is the reduced segment r."""
    return ring_over(
        Collective.REDUCE_SCATTER, tuple(range(size)), rank, count, itemsize, chunk_bytes
    )


def allgather(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """``count`` is the input length k; the output holds size * k elements, rank i's at i*k."""
    return ring_over(Collective.ALLGATHER, tuple(range(size)), rank, count, itemsize, chunk_bytes)


def ring_over(
    collective: str,
    order: Sequence[int],
    rank: int,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    algorithm: str = NAME,
) -> Schedule:
    """``collective`` as one ring through the ranks in ``order`` (``order[p]`` at ring position
    p, a permutation of the ranks): rank order for `allreduce` and co., a topology's box order
    for mdring on a one-dimensional box. Blocks stay at their RANK's offset in reduce-scatter's
    input and allgather's output, wherever the rank sits in the ring."""
    size = len(order)
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(
            collective,
            rank,
            count,
            chunk,
            rank * count if collective == Collective.ALLGATHER else 0,
            algorithm,
        )
    pos = rank if order[rank] == rank else list(order).index(rank)
    if collective == Collective.ALLREDUCE:
        segs = split(count, size)
        nchunks = nchunks_for(segs[0][1], chunk)
        steps = ring_phase(order, pos, segs, nchunks, size - 1, size - 1)
        return Schedule(collective, algorithm, rank, size, count, chunk, drop_empty(steps))
    if collective == Collective.REDUCE_SCATTER:
        seg_len = count // size
        segs = [(r * seg_len, seg_len) for r in order]  # position p ends with rank order[p]'s block
        nchunks = nchunks_for(seg_len, chunk)
        steps = ring_phase(
            order, pos, segs, nchunks, size - 1, 0, rs_dst=Buf.SCRATCH, final=(Buf.OUTPUT, 0)
        )
        return Schedule(
            collective,
            algorithm,
            rank,
            size,
            count,
            chunk,
            drop_empty(steps),
            scratch_count=count if size > 2 else 0,
        )
    if collective != Collective.ALLGATHER:
        raise ValueError(f"no ring for {collective!r}")
    own = Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, rank * count)
    segs = [(r * count, count) for r in order]
    nchunks = nchunks_for(count, chunk)
    steps = ring_phase(order, pos, segs, nchunks, 0, size - 1, ag_first_src=(Buf.INPUT, 0))
    # The local copy of our own block goes right after the first send, so the wire starts first.
    steps.insert(1, own)
    return Schedule(collective, algorithm, rank, size, count, chunk, drop_empty(steps))
