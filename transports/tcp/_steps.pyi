"""Types of the compiled ``_steps`` module (``_steps.pyx``): a collective's small steps over
leased TCP sockets."""

from typing import Final

import numpy as np

COLUMNS: Final[tuple[str, ...]]
OK: Final[int]
BROKEN: Final[int]
STALLED: Final[int]
PARTIAL: Final[int]

def run(
    table: np.ndarray,
    fds: np.ndarray,
    wakes: np.ndarray,
    bufs: np.ndarray,
    staging: int,
    itemsize: int,
    magic: int,
    data_kind: int,
    tag_base: int,
    check: int,
    dtype: int,
    op: int,
    divisor: int,
    spin_ns: int,
    stop_ns: int,
    deadline_ns: int,
) -> tuple[int, int, int]: ...
