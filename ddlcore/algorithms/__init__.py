"""Collective algorithms as schedule generators (plain data; see `schedule`).

`ALGORITHMS[collective][name]` is a function returning one rank's `Schedule`. The tuning layer
picks among the names; the engine executes whatever it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from ddlcore.algorithms import chain, dissemination, halving_doubling, mdring, ring
from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step

hd = halving_doubling
# Reduction collectives take (rank, size, count, itemsize, chunk_bytes, topo); mdring also
# dim_order. Broadcast takes root instead of topo; barrier only (rank, size).
ALGORITHMS: dict[str, dict[str, Callable[..., Schedule]]] = {
    "allreduce": {ring.NAME: ring.allreduce, mdring.NAME: mdring.allreduce,
                  hd.NAME: hd.allreduce, hd.RD_NAME: hd.allreduce_doubling},
    "reduce_scatter": {ring.NAME: ring.reduce_scatter, mdring.NAME: mdring.reduce_scatter,
                       hd.NAME: hd.reduce_scatter},
    "allgather": {ring.NAME: ring.allgather, mdring.NAME: mdring.allgather,
                  hd.NAME: hd.allgather},
    "broadcast": {chain.NAME: chain.broadcast},
    "barrier": {dissemination.NAME: dissemination.barrier},
}

__all__ = ["ALGORITHMS", "Buf", "Kind", "Schedule", "Step"]
