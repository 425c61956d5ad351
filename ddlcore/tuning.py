"""Tuning: which algorithm runs a collective, and with what chunk size.

``DDL_ALGO`` names an algorithm for the reduction collectives (allreduce, reduce_scatter,
allgather); ``auto`` takes the best registered one. Broadcast and barrier have one algorithm each
(pipelined chain, dissemination) and ignore ``DDL_ALGO``. The chunk size is ``DDL_CHUNK_BYTES``.
The choice is what ``DDL_DEBUG=1`` logs for every collective and ``python -m ddlcore info``
prints.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddlcore.algorithms import ALGORITHMS

# Collectives for which DDL_ALGO selects among several algorithms.
SELECTABLE = ("allreduce", "reduce_scatter", "allgather")
# Preference of "auto" until a cost model ranks several candidates.
AUTO_ORDER = ("ring",)


@dataclass(frozen=True)
class Choice:
    algorithm: str
    chunk_bytes: int


def validate_algo(algo: str) -> None:
    """ValueError naming DDL_ALGO if no reduction collective knows ``algo``."""
    if algo == "auto":
        return
    known = sorted({name for coll in SELECTABLE for name in ALGORITHMS[coll]})
    if algo not in known:
        raise ValueError(f"DDL_ALGO={algo!r} is not an algorithm; use auto or one of {known}")


def choose(collective: str, size: int, nbytes: int, algo: str, chunk_bytes: int) -> Choice:
    candidates = ALGORITHMS[collective]
    if collective not in SELECTABLE or algo == "auto":
        name = next((n for n in AUTO_ORDER if n in candidates), next(iter(candidates)))
    elif algo in candidates:
        name = algo
    else:
        raise ValueError(f"DDL_ALGO={algo!r} has no {collective}; it has {sorted(candidates)}")
    return Choice(name, chunk_bytes)
