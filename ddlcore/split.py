"""``Communicator.split``: sub-communicators with MPI_Comm_split's semantics.

Every rank of the parent gives a color and a key; the parent allgathers the (color, key) pairs
(int64), and the ranks of each color join a new communicator ranked by (key, parent rank),
through the parent's rendezvous store under a namespace of their own: the parent's, then
``split<n>/c<color>/``, n counting the parent's splits (the same on every rank, since a split
is collective), so two splits in a row, and splits of splits, never meet in one namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from ddlcore.communicator import Communicator

_INT64_MAX = (1 << 63) - 1


def _int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not -_INT64_MAX <= value <= _INT64_MAX:
        raise ValueError(f"{name}={value} is out of the int64 range")
    return int(value)


def members(rows: np.ndarray, color: int) -> list[int]:
    """The parent ranks of ``color``'s group in their new order: by (key, parent rank)."""
    return [r for _, r in sorted((int(k), r) for r, (c, k) in enumerate(rows) if c == color)]


def split_communicator(
    parent: Communicator,
    color: int | None,
    key: int,
    name: str,
    join: Callable[[int, int, str], Communicator],
) -> Communicator | None:
    """The child of ``parent`` this rank belongs to (None for no color), joined by ``join(rank,
    size, namespace)``."""
    color = -1 if color is None else max(_int(color, "color"), -1)
    key = _int(key, "key")
    rows = parent.allgather(np.array([color, key], np.int64)).reshape(parent.size, 2)
    if color < 0:
        return None
    ranks = members(rows, color)
    return join(ranks.index(parent.rank), len(ranks), f"{name}/c{color}")
