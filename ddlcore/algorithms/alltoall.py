"""Alltoall and alltoallv by pairwise exchange: in step i (1 .. P-1) rank r sends its block for
rank r+i and receives rank r-i's block for it, chunk by chunk; its own block is a local copy::

    step 1:   send block r+1 -> r+1         recv <- r-1 into block r-1
    step i:   send block r+i -> r+i         recv <- r-i into block r-i

Each rank sends and receives (P-1)/P of its buffer in P-1 latency steps; every step's peers are
distinct, so no link carries two steps' messages at once. Alltoall's blocks are equal (count / P
elements); alltoallv's are ``send_counts[j]`` elements to rank j, packed in rank order in the
input, and ``recv_counts[j]`` from rank j, packed likewise in the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from ddlcore.algorithms.agreement import dissemination_rounds
from ddlcore.algorithms.ring import chunk_elems
from ddlcore.algorithms.rooted import transfer
from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step, drop_empty
from ddlcore.collectives import Collective

NAME = "pairwise"
TAIL_SLOT = 1 << 20  # above any data message's slot on a pair


def alltoall(rank: int, size: int, count: int, itemsize: int, chunk_bytes: int) -> Schedule:
    """``count`` = size * k elements on every rank; block j (k elements) goes to rank j."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    k = count // size
    steps = pairwise(rank, size, (k,) * size, (k,) * size, chunk)
    return Schedule(Collective.ALLTOALL, NAME, rank, size, count, chunk, steps)


def alltoallv(
    rank: int,
    size: int,
    send_counts: Sequence[int],
    recv_counts: Sequence[int],
    itemsize: int,
    chunk_bytes: int,
) -> Schedule:
    """``send_counts[j]`` elements to rank j, ``recv_counts[j]`` from rank j (this rank's)."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    steps = pairwise(rank, size, send_counts, recv_counts, chunk) + tail(rank, size)
    return Schedule(Collective.ALLTOALLV, NAME, rank, size, sum(send_counts), chunk, steps)


def pairwise(
    rank: int, size: int, send_counts: Sequence[int], recv_counts: Sequence[int], chunk: int
) -> tuple[Step, ...]:
    """The exchange's steps, in chunks of ``chunk`` elements."""
    send_at = [0, *accumulate(send_counts)]
    recv_at = [0, *accumulate(recv_counts)]
    steps: list[Step] = []
    for i in range(1, size):
        to, frm = (rank + i) % size, (rank - i) % size
        steps += transfer(Kind.SEND, to, 0, Buf.INPUT, send_at[to], send_counts[to], chunk)
        steps += transfer(Kind.RECV, frm, 0, Buf.OUTPUT, recv_at[frm], recv_counts[frm], chunk)
    own = Step(
        Kind.COPY, -1, 0, send_counts[rank], Buf.INPUT, send_at[rank], Buf.OUTPUT, recv_at[rank]
    )
    first_recv = next((i for i, s in enumerate(steps) if s.kind == Kind.RECV), len(steps))
    steps.insert(first_recv, own)  # after the first sends: the wire starts first
    return drop_empty(steps)


def tail(rank: int, size: int) -> tuple[Step, ...]:
    """Dissemination rounds of empty messages after the data (slot `TAIL_SLOT` of their pairs):
    a rank returns only once every rank has received all its blocks, so where two ranks'
    splits disagree (which no check word can see: each rank knows only its own), the rank that
    meets the wrong length tells them all, and none returns as if the call had matched."""
    steps: list[Step] = []
    for dist in dissemination_rounds(size):
        steps.append(Step(Kind.SEND, (rank + dist) % size, TAIL_SLOT, 0, Buf.OUTPUT, 0))
        steps.append(Step(Kind.RECV, (rank - dist) % size, TAIL_SLOT, 0, dst=Buf.OUTPUT))
    return tuple(steps)
