"""Kernel source text for one element: read it into the type the arithmetic runs in, combine two,
write a result back. Shared by every kernel factory, so each rounding rule is written once.

float16 and bfloat16 are widened to float32 exactly and narrowed with one round-to-nearest-even,
as NumPy (float16), ml_dtypes (bfloat16) and the CPU kernels do, so results match bit for bit.
bfloat16 is its uint16 bit pattern: widening is ``bits << 16`` reinterpreted as float32;
narrowing adds 0x7FFF plus the lowest kept bit (ties to even) and keeps the top half, and a NaN
keeps its sign and payload with the quiet bit set (exactly the CPU kernels' ``ddl_f2b``).
"""

from __future__ import annotations

import numpy as np
from ddlcore.kernels.cuda.runtime import BFLOAT16

from ddlcore.ops import Op

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)

# ``r = x OP y``, keyed by (op, is float). The op is written into the kernel's source rather than
# called as a device function: see ``runtime``.
COMBINE = {
    (Op.SUM, False): "r = x + y",
    (Op.SUM, True): "r = x + y",
    (Op.PROD, False): "r = x * y",
    (Op.PROD, True): "r = x * y",
    (Op.MIN, False): "r = y if y < x else x",
    (Op.MAX, False): "r = y if y > x else x",
    # NaN-propagating, like np.minimum / np.maximum
    (Op.MIN, True): "r = x if x != x else (y if (y < x or y != y) else x)",
    (Op.MAX, True): "r = x if x != x else (y if (y > x or y != y) else x)",
}

# Round-to-nearest-even float32 -> bfloat16 on the bit pattern. Every intermediate fits 32 bits
# (NaNs, the only patterns near 2**32, take the other branch), so Numba's 64-bit integer
# arithmetic and the simulator's NumPy uint32 arithmetic agree; the np.uint32() lets LLVM keep
# the sum in 32-bit registers.
_NARROW_BFLOAT16 = """\
bits = float32_bits({value})
if {value} != {value}:  # NaN: sign and payload kept, quiet bit set
    {target} = np.uint16((bits | np.uint32(0x400000)) >> np.uint32(16))
else:  # to nearest, ties to even: add 0x7FFF plus the lowest bit kept, keep the top half
    rounded = np.uint32(bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    {target} = np.uint16(rounded >> np.uint32(16))"""


def combine(op: Op, dtype: np.dtype) -> str:
    """``r = x OP y`` for elements of ``dtype`` (half types combine in float32)."""
    key = (Op(op), np.dtype(dtype).kind == "f" or dtype == BFLOAT16)
    if key not in COMBINE:
        raise ValueError(
            f"op={op!r} is not an element-wise reduction (avg is sum, then a division)"
        )
    return COMBINE[key]


def work_type(*dtypes: np.dtype) -> str:
    """The float type arithmetic between these (float) element types runs in, as source text:
    float64 when one of them is float64, else float32."""
    return "np.float64" if F64 in dtypes else "np.float32"


def widen(dtype: np.dtype, expr: str, work: str = "") -> str:
    """Source of ``expr`` (an element of ``dtype``) as the ``work`` type ("np.float32",
    "np.float64"; "" keeps the native type of float32/float64/integers, float32 for halves)."""
    if dtype == BFLOAT16:
        value = f"float32_from_bits(np.uint32({expr}) << np.uint32(16))"
        return f"np.float64({value})" if work == "np.float64" else value
    if dtype == F16:
        return f"{work or 'np.float32'}({expr})"
    return f"{work}({expr})" if work else expr


def narrow(dtype: np.dtype, value: str, target: str) -> str:
    """Statements setting ``target`` to ``value`` (a float32 or float64 variable) rounded once to
    ``dtype``; float64 -> bfloat16 goes through float32, as ml_dtypes does."""
    if dtype == BFLOAT16:
        return f"{value}_f32 = np.float32({value})\n" + _NARROW_BFLOAT16.format(
            value=f"{value}_f32", target=target
        )
    if np.dtype(dtype).kind == "f":
        return f"{target} = np.{np.dtype(dtype).name}({value})"
    return f"{target} = {value}"
