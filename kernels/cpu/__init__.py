"""Cython CPU kernels: reduce, fused reduce-copy, avg's division, copy, pack and unpack.

All take raw addresses and element counts (see ``_reduce.pyx`` and ``_pack.pyx``) and release the
GIL for the whole loop, so the engine's reductions overlap with the transports' threads.
"""

from ddlcore.kernels.cpu._pack import arrays_between, pack, unpack
from ddlcore.kernels.cpu._reduce import (
    array_address,
    avg_finalize,
    copy_bytes,
    reduce_copy,
    reduce_into,
)

__all__ = [
    "array_address",
    "arrays_between",
    "avg_finalize",
    "copy_bytes",
    "pack",
    "reduce_copy",
    "reduce_into",
    "unpack",
]
