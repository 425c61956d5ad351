"""The collectives by name: `Collective`, a str enum whose members equal, hash and print as the
strings the public API takes and returns ("allreduce", ...), so comparisons with plain strings,
dict keys, JSON (flight records, traces) and log lines read the same as before it existed."""

from __future__ import annotations

import enum


class Collective(str, enum.Enum):
    """One of the collectives a `Communicator` runs (new members go last: `calls.fingerprint`
    numbers them by position)."""

    ALLREDUCE = "allreduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    BARRIER = "barrier"
    REDUCE = "reduce"
    GATHER = "gather"
    SCATTER = "scatter"
    ALLTOALL = "alltoall"
    ALLTOALLV = "alltoallv"

    # The value, as `enum.StrEnum` (3.11) does: f"{c}" and "%s" % c must read "allreduce".
    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


# The collectives with a root (whose calls differ by it).
HAS_ROOT = frozenset(
    {Collective.BROADCAST, Collective.REDUCE, Collective.GATHER, Collective.SCATTER}
)
