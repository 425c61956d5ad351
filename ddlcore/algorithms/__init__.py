"""Collective algorithms as schedule generators (plain data; see `schedule`).

`ALGORITHMS[collective][name]` is a function returning one rank's `Schedule`. The tuning layer
picks among the names; the engine executes whatever it is given.
"""

from __future__ import annotations

from collections.abc import Callable

from ddlcore.algorithms import (
    alltoall,
    chain,
    dissemination,
    halving_doubling,
    mdring,
    ring,
    rooted,
)
from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step
from ddlcore.collectives import Collective

hd = halving_doubling
# Reduction collectives take (rank, size, count, itemsize, chunk_bytes, topo); mdring also
# dim_order. Broadcast, reduce, gather and scatter take root instead of topo; alltoall no topo;
# alltoallv (rank, size, send_counts, recv_counts, itemsize, chunk_bytes); barrier (rank, size).
ALGORITHMS: dict[str, dict[str, Callable[..., Schedule]]] = {
    Collective.ALLREDUCE: {
        ring.NAME: ring.allreduce,
        mdring.NAME: mdring.allreduce,
        hd.NAME: hd.allreduce,
        hd.RD_NAME: hd.allreduce_doubling,
    },
    Collective.REDUCE_SCATTER: {
        ring.NAME: ring.reduce_scatter,
        mdring.NAME: mdring.reduce_scatter,
        hd.NAME: hd.reduce_scatter,
    },
    Collective.ALLGATHER: {
        ring.NAME: ring.allgather,
        mdring.NAME: mdring.allgather,
        hd.NAME: hd.allgather,
    },
    Collective.BROADCAST: {chain.NAME: chain.broadcast},
    Collective.BARRIER: {dissemination.NAME: dissemination.barrier},
    Collective.REDUCE: {rooted.REDUCE_NAME: rooted.reduce},
    Collective.GATHER: {rooted.NAME: rooted.gather},
    Collective.SCATTER: {rooted.NAME: rooted.scatter},
    Collective.ALLTOALL: {alltoall.NAME: alltoall.alltoall},
    Collective.ALLTOALLV: {alltoall.NAME: alltoall.alltoallv},
}

__all__ = ["ALGORITHMS", "Buf", "Kind", "Schedule", "Step"]
