"""The host collectives as the execution paths name them: the shm transport's boards
(``ddlcore.transports.shm.boards``), which a communicator gets by asking its contexts
(`Context.host_collectives`, in ``bootstrap``), re-exported here for the paths and tools."""

from __future__ import annotations

from ddlcore.planning import tuning
from ddlcore.transports.shm.board_calls import DIRECT, SLOTS, SYNC_ONLY, BoardCall, BoardKind
from ddlcore.transports.shm.boards import (
    CHUNK_BYTES,
    MAX_RANKS,
    NAME,
    SMALL_MAX,
    HostCollectives,
    slots_max,
)
from ddlcore.transports.shm.segments import cma_allowed

assert NAME == tuning.DIRECT  # DDL_ALGO's name for them, declared in both layers


__all__ = [
    "CHUNK_BYTES",
    "DIRECT",
    "MAX_RANKS",
    "NAME",
    "SLOTS",
    "SMALL_MAX",
    "slots_max",
    "SYNC_ONLY",
    "BoardCall",
    "BoardKind",
    "HostCollectives",
    "cma_allowed",
]
