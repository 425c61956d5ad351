"""Chunked, pipelined ring reduce-scatter, allgather and allreduce (allreduce = RS + AG).

The P ranks form a ring; rank r sends to r+1 and receives from r-1. The buffer is cut into P
segments (the first ``count % P`` one element longer) and each segment into C chunks.

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

NAME = "ring"


def _ring_program(rank: int, size: int, segs: list[tuple[int, int]], nchunks: int,
                  rs_steps: int, ag_steps: int, rs_dst: Buf, final_dst_off: int,
                  ag_input_first: bool, slot_base: int = 0) -> list[Step]:
    """Steps of rank ``rank`` for ``rs_steps`` reduce-scatter then ``ag_steps`` allgather steps.

    ``segs`` are (offset, length) of each segment in the full-size buffers (INPUT for RS,
    OUTPUT for AG). ``rs_dst`` is where intermediate reductions go (OUTPUT for allreduce,
    SCRATCH for reduce-scatter). ``final_dst_off`` is where the final RS reduction goes (for
    allreduce: the segment's own place; for reduce-scatter: OUTPUT[0]). When
    ``ag_input_first`` (plain allgather), the first send comes from INPUT[0:].
    """
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    total = rs_steps + ag_steps
    chunked = [chunks_of(off, length, nchunks) for off, length in segs]

    def rs_seg(s: int, sending: bool) -> int:
        return (rank - s - (1 if sending else 2)) % size

    def ag_seg(s: int, sending: bool) -> int:
        return (rank - s - (0 if sending else 1)) % size

    # Where the data of global step g, chunk c lives after this rank received it (or, for the
    # first send, before): (buffer, offset, count).
    def recv_place(g: int, c: int) -> tuple[Buf, int, int]:
        if g < rs_steps:
            seg = rs_seg(g, False)
            off, cnt = chunked[seg][c]
            if g == rs_steps - 1 and ag_steps == 0:
                return Buf.OUTPUT, final_dst_off + off - segs[seg][0], cnt
            return rs_dst, off, cnt
        seg = ag_seg(g - rs_steps, False)
        off, cnt = chunked[seg][c]
        return Buf.OUTPUT, off, cnt

    def first_send(c: int) -> Step:
        if rs_steps:
            seg = rs_seg(0, True)
            off, cnt = chunked[seg][c]
            return Step(Kind.SEND, nxt, slot_base + c, cnt, Buf.INPUT, off)
        off, cnt = chunked[rank][c]
        src, src_off = (Buf.INPUT, off - segs[rank][0]) if ag_input_first else (Buf.OUTPUT, off)
        return Step(Kind.SEND, nxt, slot_base + c, cnt, src, src_off)

    def unit(g: int, c: int) -> list[Step]:
        slot = slot_base + g * nchunks + c
        buf, off, cnt = recv_place(g, c)
        if g < rs_steps:
            seg = rs_seg(g, False)
            in_off = chunked[seg][c][0]
            op = Step(Kind.RECV_REDUCE, prv, slot, cnt, Buf.INPUT, in_off, buf, off,
                      finalize=(g == rs_steps - 1))
        else:
            op = Step(Kind.RECV, prv, slot, cnt, dst=buf, dst_off=off)
        out = [op]
        if g + 1 < total:
            out.append(Step(Kind.SEND, nxt, slot + nchunks, cnt, buf, off))
        return out

    steps: list[Step] = []
    for wave in range(total + nchunks):
        for c in range(max(0, wave - total), min(nchunks - 1, wave) + 1):
            g = wave - 1 - c
            steps.extend([first_send(c)] if g < 0 else unit(g, c))
    return steps


def _chunk_elems(chunk_bytes: int, itemsize: int) -> int:
    return max(1, chunk_bytes // max(1, itemsize))


def allreduce(rank: int, size: int, count: int, itemsize: int, chunk_bytes: int) -> Schedule:
    chunk = _chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        copy = (Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, 0),)
        return Schedule("allreduce", NAME, rank, size, count, chunk, drop_empty(copy))
    segs = split(count, size)
    nchunks = nchunks_for(segs[0][1], chunk)
    steps = _ring_program(rank, size, segs, nchunks, size - 1, size - 1, Buf.OUTPUT,
                          0, ag_input_first=False)
    return Schedule("allreduce", NAME, rank, size, count, chunk, drop_empty(steps))


def reduce_scatter(rank: int, size: int, count: int, itemsize: int, chunk_bytes: int) -> Schedule:
    """``count`` is the input length (size * k); rank r's output is the reduced segment r."""
    chunk = _chunk_elems(chunk_bytes, itemsize)
    seg_len = count // size
    if size == 1:
        copy = (Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, 0),)
        return Schedule("reduce_scatter", NAME, rank, size, count, chunk, drop_empty(copy))
    segs = [(i * seg_len, seg_len) for i in range(size)]
    nchunks = nchunks_for(seg_len, chunk)
    steps = _ring_program(rank, size, segs, nchunks, size - 1, 0, Buf.SCRATCH, 0,
                          ag_input_first=False)
    return Schedule("reduce_scatter", NAME, rank, size, count, chunk, drop_empty(steps),
                    scratch_count=count if size > 2 else 0)


def allgather(rank: int, size: int, count: int, itemsize: int, chunk_bytes: int) -> Schedule:
    """``count`` is the input length k; the output holds size * k elements, rank i's at i*k."""
    chunk = _chunk_elems(chunk_bytes, itemsize)
    own = Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, rank * count)
    if size == 1:
        return Schedule("allgather", NAME, rank, size, count, chunk, drop_empty((own,)))
    segs = [(i * count, count) for i in range(size)]
    nchunks = nchunks_for(count, chunk)
    steps = _ring_program(rank, size, segs, nchunks, 0, size - 1, Buf.OUTPUT, 0,
                          ag_input_first=True)
    # The local copy of our own block goes right after the first send, so the wire starts first.
    steps.insert(1, own)
    return Schedule("allgather", NAME, rank, size, count, chunk, drop_empty(steps))
