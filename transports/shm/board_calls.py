"""What one call of the boards (``boards.HostCollectives.run``) is: its kind (`BoardKind`, the
native engine's ``DDL_K_*``), how it runs (`SLOTS`, `DIRECT`, `SYNC_ONLY`) and its arguments
on host addresses (`BoardCall`)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# How a call runs (_arena.Arena.run's mode).
SLOTS, DIRECT, SYNC_ONLY = 0, 1, 2


class BoardKind(enum.IntEnum):
    """What one board call does (ddl_arena.h's DDL_K_*): a collective, or one of an allreduce's
    halves around its network phases (mdring across hosts): each rank reduces its part of
    everyone's input into its output (`HOST_REDUCE_SCATTER`); later each copies the others'
    parts from theirs (`HOST_ALLGATHER`)."""

    ALLREDUCE = 1
    REDUCE_SCATTER = 2
    ALLGATHER = 3
    BROADCAST = 4
    BARRIER = 5
    HOST_REDUCE_SCATTER = 6
    HOST_ALLGATHER = 7
    # Collectives the boards only compare at a sync point (they run as schedules).
    REDUCE = 8
    GATHER = 9
    SCATTER = 10
    ALLTOALL = 11
    ALLTOALLV = 12

    @classmethod
    def of(cls, collective: str) -> BoardKind:
        """The kind of a collective, by its name (``ddlcore.collectives.Collective``)."""
        name = str(collective).upper()
        if name.startswith("HOST_") or name not in cls.__members__:
            raise ValueError(f"{collective!r} is not a collective")
        return cls[name]

    @property
    def phase(self) -> str | None:
        """The allreduce's half this kind is ("host reduce-scatter"), None for a collective."""
        return _PHASES.get(self)

    @property
    def label(self) -> str:
        """As messages name it: "allgather", "allreduce, host reduce-scatter"."""
        phase = self.phase
        return self.name.lower() if phase is None else f"allreduce, {phase}"


_PHASES = {
    BoardKind.HOST_REDUCE_SCATTER: "host reduce-scatter",
    BoardKind.HOST_ALLGATHER: "host allgather",
}


@dataclass
class BoardCall:
    """One call of `HostCollectives.run`, on host addresses: ``count`` input elements of
    ``itemsize`` bytes and kernel dtype code ``dtype``; ``op`` a kernel op code (SUM for avg,
    with ``divisor`` the number of ranks; 0 for no division); ``check`` the call's check word,
    compared at every sync point; ``label()`` names the call in errors; ``mode`` `SLOTS`,
    `DIRECT` or `SYNC_ONLY`; ``keep``: the buffers behind ``inp`` and ``out``, held for good
    if a failed call leaves a peer that might still write into them."""

    kind: BoardKind
    inp: int
    out: int
    count: int
    itemsize: int
    dtype: int
    op: int
    check: int
    label: Callable[[], str]
    mode: int = 0  # SLOTS
    divisor: int = 0
    root: int = 0
    keep: Any = None
