"""Dissemination barrier: ceil(log2 P) rounds of empty messages.

In round k rank r sends to r + 2^k and receives from r - 2^k. After the last round every rank has
heard, directly or through others, from every rank, so none leaves before all arrived::

    round 0: r -> r+1     round 1: r -> r+2     round 2: r -> r+4 ...
"""

from __future__ import annotations

from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step
from ddlcore.collectives import Collective

NAME = "dissemination"


def barrier(rank: int, size: int) -> Schedule:
    steps: list[Step] = []
    dist, rnd = 1, 0
    while dist < size:
        steps.append(Step(Kind.SEND, (rank + dist) % size, rnd, 0, Buf.OUTPUT, 0))
        steps.append(Step(Kind.RECV, (rank - dist) % size, rnd, 0, dst=Buf.OUTPUT, dst_off=0))
        dist, rnd = dist * 2, rnd + 1
    return Schedule(Collective.BARRIER, NAME, rank, size, 0, 1, tuple(steps))
