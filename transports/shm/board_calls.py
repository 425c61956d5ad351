"""What one call of the boards (``boards.HostCollectives.run``) is: its kind (`BoardKind`, the
native engine's ``DDL_K_*``), how it runs (`SLOTS`, `DIRECT`, `SYNC_ONLY`) and its arguments
on host addresses (`BoardCall`); and how a mismatch names a rank's call from what it published
on its board (`describe_entry`)."""

from __future__ import annotations

import enum
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddlcore.kernels.dtypes import BOOL_CODE, DType, dtype_name

from ddlcore.ops import Op

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


_NONE = 255  # no op (and no dtype: barrier), in a check word
_REDUCING = frozenset(
    {BoardKind.ALLREDUCE, BoardKind.REDUCE_SCATTER, BoardKind.REDUCE, BoardKind.HOST_REDUCE_SCATTER}
)
_ROOTED = frozenset({BoardKind.BROADCAST, BoardKind.REDUCE, BoardKind.GATHER, BoardKind.SCATTER})


def check_word(kind: int, code: int, op: int, count: int, root: int, chunk: int = 0) -> int:
    """A call's check word as ``ddlcore.execution._frontend.check_word`` computes it (CRC-32 of
    the packed fields, odd); the transports name calls with it, and cannot import that layer."""
    raw = struct.pack("<BBBqqq", kind & 0xFF, code & 0xFF, op & 0xFF, count, root, chunk)
    return zlib.crc32(raw) | 1


def describe_entry(entry: tuple[int, int, int, int, int], check: int | None = None) -> str:
    """A rank's board call as messages name it, from its board's entry (kind, kernel dtype,
    kernel op, root, count) and its ``check`` word: "allreduce(1000 x float32, avg)". The
    entry holds what the kernels run (sum for avg, uint8 for bool, an op even where the call has
    none); the check word tells which call that was. Without it (or where it names none of
    them: an allreduce's host phase on a segment) the entry's own names."""
    kind, dtype, op, root, count = entry
    root = root - (1 << 32) if root >= 1 << 31 else root  # an integer avg's negative marker
    try:
        board_kind = BoardKind(kind)
    except ValueError:
        return f"kind {kind}({count} x {dtype_name(dtype)}, op code {op})"
    reducing = board_kind in _REDUCING
    codes = [dtype, BOOL_CODE] if dtype == DType.UINT8 else [dtype]
    ops = ([op, int(Op.AVG)] if op == Op.SUM else [op]) if reducing else [_NONE]
    if check is not None:
        for code in codes:
            for candidate in ops:
                if check_word(kind, code, candidate, count, root) == check:
                    return _words(board_kind, code, candidate, root, count)
    return _words(board_kind, dtype, op if reducing else _NONE, root, count)


def _words(kind: BoardKind, code: int, op: int, root: int, count: int) -> str:
    """As ``ddlcore.calls.describe_call`` words a call: "allreduce(1000 x float32, sum)"."""
    name = kind.name.lower() if kind.phase is None else f"allreduce's {kind.phase}"
    if kind == BoardKind.BARRIER:
        return "barrier()"
    if root < 0 and -1 - root in {int(c) for c in DType}:  # int_avg: the wide sum of an avg
        return f"{name}({count} x {dtype_name(-1 - root)}, avg)"
    text = f"{count} x {dtype_name(code)}"
    if op != _NONE:
        try:
            text += f", {Op(op).name.lower()}"
        except ValueError:
            text += f", op code {op}"
    if kind in _ROOTED:
        text += f", root {root}"
    return f"{name}({text})"
