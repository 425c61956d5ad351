"""Integer ``avg``: the exact mean of the ranks' values rounded down (floor, toward minus
infinity), whatever the dtype's range.

Summing int8 100 and 101 in int8 wraps before the division (the mean would come out -27), so an
integer avg never reduces in its own dtype. It runs as one "sum" collective on a wider buffer
and one local division:

* int8, uint8, int32: each value widened (int8/uint8 to int32 up to 2**23 ranks, else int64;
  int32 to int64); the sum of P values cannot overflow; ``floor(sum / P)`` fits the dtype.
* int64: each value split as ``x = P*q + r`` with ``q = floor(x / P)`` and ``0 <= r < P``; the
  q's and the r's are summed; the mean is ``sum(q) + floor(sum(r) / P)``. The r's add up to at
  most P*(P-1), exactly; a sum of q's can leave int64's range by less than P (at the minimum),
  and wraps, harmlessly: the sums wrap modulo 2**64 and the mean itself lies in int64's range.

Every rank computes the same wide sum (the collectives' results are identical everywhere) and the
same division, so the result is identical on every rank and on every path (boards, schedules,
device buffers staged through host memory). The price is bandwidth: 4 or 8 bytes per int8/uint8
element, 8 per int32 and 16 per int64 travel instead of the dtype's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ddlcore.buffers import as_buffer
from ddlcore.calls import Call
from ddlcore.collectives import Collective
from ddlcore.kernels.dtypes import DType, numpy_dtype
from ddlcore.ops import Op

_NARROW_WIDE_LIMIT = 1 << 23  # ranks whose int8/uint8 sum still fits int32 (255 * 2**23 < 2**31)


def marker(call: Call) -> int:
    """The wide sum's ``root`` (unused by allreduce and reduce_scatter): negative and naming the
    avg's own dtype, so that it enters the call's check word and fingerprint, and a rank's int32
    avg never agrees with another rank's int64 sum of the same count."""
    assert call.inp is not None
    return -1 - int(call.inp.code)


def avg_dtype(root: int) -> str | None:
    """The dtype name of the integer avg a wide sum with this ``root`` stands for, else None."""
    if root >= 0:
        return None
    try:
        return numpy_dtype(DType(-1 - root)).name
    except (ValueError, KeyError):
        return None


def applies(call: Call, size: int) -> bool:
    """Whether ``call`` is an integer avg over more than one rank (run by `run`)."""
    return call.op == Op.AVG and size > 1 and call.inp is not None and call.inp.dtype.kind in "iu"


def widen(x: np.ndarray, size: int, blocks: int) -> np.ndarray:
    """The wide buffer whose "sum" over ``size`` ranks `finish` turns into the floor of the mean
    of ``x`` (1-D; ``blocks`` = size for reduce_scatter, whose block j must stay block j)."""
    if x.dtype.itemsize == 8:
        k = x.size // blocks
        wide = np.empty((blocks, 2, k), np.int64)
        q = np.floor_divide(x, size).reshape(blocks, k)
        wide[:, 0] = q
        with np.errstate(over="ignore"):  # x - q*size is exact in wrapping arithmetic
            wide[:, 1] = x.reshape(blocks, k) - q * size
        return wide.reshape(-1)
    wide_type = np.int32 if x.dtype.itemsize == 1 and size <= _NARROW_WIDE_LIMIT else np.int64
    return x.astype(wide_type)


def finish(total: np.ndarray, size: int, out: np.ndarray) -> None:
    """Write the floor of the mean into ``out`` (1-D) from the summed wide buffer ``total``."""
    if out.dtype.itemsize == 8:
        k = total.size // 2
        q, r = total[:k], total[k:]
        np.add(q, r // size, out=out)
        return
    out[...] = np.floor_divide(total, size).astype(out.dtype)


def run(
    call: Call,
    size: int,
    host: tuple[np.ndarray, np.ndarray] | None,
    execute: Callable[[Call], Any],
) -> None:
    """Run the integer avg ``call`` (an allreduce or reduce_scatter) as a "sum" of its wide
    buffer through ``execute`` (the communicator's own execution, same sequence number), then
    divide into the call's output. ``host``: the input and output in host memory when the
    call's buffers are on a GPU (the caller uploads the output)."""
    assert call.inp is not None and call.out is not None
    inp, out = host if host is not None else (call.inp.array, call.out.array)
    x, y = inp.reshape(-1), out.reshape(-1)
    blocks = size if call.collective == Collective.REDUCE_SCATTER else 1
    wide = widen(x, size, blocks)
    total = np.empty(wide.size // blocks, wide.dtype)
    execute(
        Call(
            call.collective,
            as_buffer(wide),
            as_buffer(total, "out"),
            Op.SUM,
            marker(call),
            total,
            None,
            wide.size,
        )
    )
    finish(total, size, y)
