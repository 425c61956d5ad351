"""Pipelined chain broadcast: root -> root+1 -> ... -> root-1, chunk by chunk.

Position p = (rank - root) mod P. The root sends every chunk to p+1; each middle rank receives
chunk c in place and forwards it while chunk c+1 is arriving; the last rank only receives::

    root:   send c0, send c1, ...
    middle: recv c0, send c0, recv c1, send c1, ...
    last:   recv c0, recv c1, ...

Time ~ (P - 2 + C) chunk transfers; every link carries n bytes once (busbw = algbw).
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
)
from ddlcore.collectives import Collective

NAME = "chain"


def broadcast(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, root: int
) -> Schedule:
    chunk = max(1, chunk_bytes // max(1, itemsize))
    pos = (rank - root) % size
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    steps: list[Step] = []
    if size > 1:
        for slot, (off, cnt) in enumerate(chunks_of(0, count, nchunks_for(count, chunk))):
            if pos > 0:
                steps.append(Step(Kind.RECV, prv, slot, cnt, dst=Buf.OUTPUT, dst_off=off))
            if pos < size - 1:
                steps.append(Step(Kind.SEND, nxt, slot, cnt, Buf.OUTPUT, off))
    return Schedule(Collective.BROADCAST, NAME, rank, size, count, chunk, drop_empty(steps))
