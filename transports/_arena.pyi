"""Types of the compiled ``_arena`` module (``_arena.pyx``): the host collectives' native half."""

from collections.abc import Sequence
from typing import Final

MAX_RANKS: Final[int]  # ddl_arena.h's DDL_ARENA_MAX (64)
HEADER_BYTES: Final[int]  # ddl_arena.h's DDL_A_HEADER (4096)

class Arena:
    def __init__(
        self,
        rank: int,
        size: int,
        boards: Sequence[int],
        pids: Sequence[int],
        pidfds: Sequence[int],
        slot_bytes: int,
        chunk: int,
    ) -> None: ...
    def run(
        self,
        mode: int,
        kind: int,
        inp: int,
        out: int,
        count: int,
        itemsize: int,
        dtype: int,
        op: int,
        divisor: int,
        root: int,
        check: int,
        deadline: float,
    ) -> int: ...
    def settle(self, deadline: float) -> bool: ...
    @property
    def address(self) -> int: ...
    @property
    def bad_rank(self) -> int: ...
    @property
    def err(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    def entry(self, q: int) -> tuple[int, int, int, int, int]: ...
    def abort_note(self, q: int) -> tuple[int, bytes]: ...
    def abort(self, code: int, reason: bytes) -> None: ...
