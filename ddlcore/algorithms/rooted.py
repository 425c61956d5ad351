"""Reduce, gather and scatter: the collectives whose result lives on (or comes from) one rank.

Reduce is the ring allreduce's first half, then a gather of the reduced segments to the root::

    ring reduce-scatter (P-1 steps, as `ring`): rank r ends with segment r fully reduced
    gather: rank r != root sends segment r -> root       root: recv each segment in place

The reduce-scatter is `ring.ring_phase` on the same segments and chunks as the ring allreduce,
so the root's result equals ``DDL_ALGO=ring``'s allreduce bit for bit. Each rank sends
(P-1)/P * n + n/P bytes; the root receives (P-1)/P * n twice. Non-roots reduce in scratch.

Gather and scatter are linear (direct): every rank's block goes straight to (comes straight from) the
root, chunk by chunk, in rank order from root+1 round::

    gather:   rank r != root: send input -> root      root: copy own, recv block q <- q
    scatter:  root: send block q -> q, copy own        rank r != root: recv <- root

The root moves (P-1) * k elements, the others k; P-1 latency steps at the root.
"""

from __future__ import annotations

from ddlcore.algorithms.ring import chunk_elems, local_copy, ring_phase, span_slots
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

REDUCE_NAME = "ring"
NAME = "linear"


def transfer(
    kind: Kind, peer: int, slot: int, buf: Buf, offset: int, count: int, chunk: int
) -> list[Step]:
    """``count`` elements at ``buf[offset]`` sent to (or received from) ``peer`` in chunks of
    ``chunk``, slots ``slot``, ``slot + 1``, ..."""
    pieces = chunks_of(offset, count, nchunks_for(count, chunk))
    if kind == Kind.SEND:
        return [Step(Kind.SEND, peer, slot + c, n, buf, off) for c, (off, n) in enumerate(pieces)]
    return [
        Step(Kind.RECV, peer, slot + c, n, dst=buf, dst_off=off)
        for c, (off, n) in enumerate(pieces)
    ]


def reduce(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, root: int
) -> Schedule:
    """``count`` elements on every rank, reduced into the root's output."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(Collective.REDUCE, rank, count, chunk, algorithm=REDUCE_NAME)
    segs = split(count, size)
    nchunks = nchunks_for(segs[0][1], chunk)
    acc = Buf.OUTPUT if rank == root else Buf.SCRATCH
    steps = ring_phase(tuple(range(size)), rank, segs, nchunks, size - 1, 0, rs_dst=acc)
    base = span_slots(size - 1, 0, nchunks)
    if rank != root:
        off, n = segs[rank]
        steps += transfer(Kind.SEND, root, base, acc, off, n, chunk)
    else:
        for q in _others(root, size):
            off, n = segs[q]
            steps += transfer(Kind.RECV, q, base, Buf.OUTPUT, off, n, chunk)
    return Schedule(
        Collective.REDUCE,
        REDUCE_NAME,
        rank,
        size,
        count,
        chunk,
        drop_empty(steps),
        scratch_count=0 if rank == root else count,
    )


def gather(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, root: int
) -> Schedule:
    """``count`` elements on every rank; the root's output holds rank q's at q * count."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if rank != root:
        steps = transfer(Kind.SEND, root, 0, Buf.INPUT, 0, count, chunk)
    else:
        steps = [Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, root * count)]
        for q in _others(root, size):
            steps += transfer(Kind.RECV, q, 0, Buf.OUTPUT, q * count, count, chunk)
    return Schedule(Collective.GATHER, NAME, rank, size, count, chunk, drop_empty(steps))


def scatter(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, root: int
) -> Schedule:
    """The root's input holds rank q's ``count`` elements at q * count; each output gets its."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if rank != root:
        steps = transfer(Kind.RECV, root, 0, Buf.OUTPUT, 0, count, chunk)
    else:
        steps = []
        for q in _others(root, size):
            steps += transfer(Kind.SEND, q, 0, Buf.INPUT, q * count, count, chunk)
        # The own block's copy after the first sends: the wire starts first.
        steps.insert(min(1, len(steps)), _own(root * count, 0, count))
    return Schedule(Collective.SCATTER, NAME, rank, size, count, chunk, drop_empty(steps))


def _own(src_off: int, dst_off: int, count: int) -> Step:
    return Step(Kind.COPY, -1, 0, count, Buf.INPUT, src_off, Buf.OUTPUT, dst_off)


def _others(root: int, size: int) -> list[int]:
    return [(root + i) % size for i in range(1, size)]
