"""Collective algorithms as schedule generators (plain data; see `schedule`).

`ALGORITHMS[collective][name]` is a function returning one rank's `Schedule`. The tuning layer
picks among the names; the engine executes whatever it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from ddlcore.algorithms import chain, dissemination, ring
from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step

ALGORITHMS: dict[str, dict[str, Callable[..., Schedule]]] = {
    "allreduce": {ring.NAME: ring.allreduce},
    "reduce_scatter": {ring.NAME: ring.reduce_scatter},
    "allgather": {ring.NAME: ring.allgather},
    "broadcast": {chain.NAME: chain.broadcast},
    "barrier": {dissemination.NAME: dissemination.barrier},
}

__all__ = ["ALGORITHMS", "Buf", "Kind", "Schedule", "Step"]
