"""Types of the compiled ``_pack`` module (``_pack.pyx``): fused pack and unpack over addresses."""

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import numpy as np
import numpy.typing as npt

# A table of addresses or byte counts: any sequence of ints, or a NumPy integer array.
_Table: TypeAlias = Sequence[int] | npt.NDArray[np.integer[Any]]

def pack(dst: int, srcs: _Table, nbytes: _Table) -> int: ...
def unpack(src: int, dsts: _Table, nbytes: _Table) -> int: ...
def arrays_between(
    flat: int, capacity: int, arrays: Iterable[np.ndarray], to_flat: bool
) -> int: ...
