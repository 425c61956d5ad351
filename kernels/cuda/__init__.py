"""Numba CUDA kernels: reduce and reduce-copy (``reduce``), float32 accumulation of half-precision
data (``widen``), and the one-launch fused pack/unpack of K tensors (``packing``). ``runtime``,
``elements`` and ``primitives`` are what they are built from; ``ptx`` compiles every kernel
without a GPU. Importing this package does not import numba.

bfloat16 device data lives in uint16 (or int16) arrays holding the bit patterns; the functions
take ``dtype="bfloat16"`` (``flat_dtype`` / ``dtype`` for pack) to say so.
"""

from ddlcore.kernels.cuda.packing import pack, pack_addresses, unpack, unpack_addresses
from ddlcore.kernels.cuda.ptx import compile_all_ptx, ptxas_usage
from ddlcore.kernels.cuda.reduce import avg_scale, reduce_copy, reduce_into
from ddlcore.kernels.cuda.runtime import DTYPES, KERNEL_DTYPES, launch_config, unusable_reason
from ddlcore.kernels.cuda.widen import narrow_copy, reduce_widen, widen_copy


def describe() -> str:
    """One line for ``python -m ddlcore info``."""
    return (
        f"Numba CUDA: reduce-copy sum/prod/min/max and avg scale for "
        f"{', '.join(KERNEL_DTYPES)}; float32 accumulation of float16/bfloat16; "
        "one-launch pack/unpack of K tensors with cast and scale"
    )


__all__ = [
    "DTYPES",
    "KERNEL_DTYPES",
    "avg_scale",
    "compile_all_ptx",
    "describe",
    "launch_config",
    "narrow_copy",
    "pack",
    "pack_addresses",
    "ptxas_usage",
    "reduce_copy",
    "reduce_into",
    "reduce_widen",
    "unpack",
    "unpack_addresses",
    "unusable_reason",
    "widen_copy",
]
