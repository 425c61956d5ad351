"""Element types the kernels understand, as small integer codes shared by every kernel backend.

The codes are what the Cython (and later CUDA) kernels dispatch on; `dtype_code` maps a NumPy
dtype (including ml_dtypes' bfloat16) to its code, and `numpy_dtype` maps back.

bool is no kernel type: its bytes (0 or 1) reduce as uint8 (`dtype_code` gives UINT8), with the
ops `ddlcore.ops.logical` picks. Where ranks compare calls (check words, fingerprints, messages)
a bool buffer carries `BOOL_CODE` (`check_code`), so that it never passes for uint8; `dtype_name`
names every code.
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.IntEnum):
    FLOAT16 = 0
    BFLOAT16 = 1
    FLOAT32 = 2
    FLOAT64 = 3
    INT8 = 4
    UINT8 = 5
    INT32 = 6
    INT64 = 7


_NUMPY = {
    DType.FLOAT16: np.dtype(np.float16),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT64: np.dtype(np.float64),
    DType.INT8: np.dtype(np.int8),
    DType.UINT8: np.dtype(np.uint8),
    DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64),
}
_CODES = {dt: code for code, dt in _NUMPY.items()}

_BOOL = np.dtype(np.bool_)
# Beyond the kernels' codes: a bool buffer's code where calls are compared (not a DType).
BOOL_CODE = 8
_CODES[_BOOL] = DType.UINT8  # its bytes, 0 or 1, reduce as uint8
_NAMES = {**{int(code): dt.name for code, dt in _NUMPY.items()}, BOOL_CODE: "bool"}

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(_NUMPY.values())  # the kernels' types
ACCEPTED_DTYPES: tuple[np.dtype, ...] = (*SUPPORTED_DTYPES, _BOOL)  # the collectives' too


def dtype_code(dtype: np.dtype) -> DType | None:
    """The kernel code of a NumPy dtype (native byte order), or None when unsupported (bool:
    UINT8, the type its bytes reduce as)."""
    return _CODES.get(np.dtype(dtype))


def check_code(dtype: np.dtype) -> int | None:
    """The code of a NumPy dtype where ranks compare calls: its kernel code, `BOOL_CODE` for
    bool; None when unsupported."""
    dt = np.dtype(dtype)
    if dt == _BOOL:
        return BOOL_CODE
    code = _CODES.get(dt)
    return None if code is None else int(code)


def dtype_name(code: int) -> str:
    """The dtype a kernel code or `BOOL_CODE` stands for ("float32", "bool"), for messages;
    "dtype code N" for a number that is neither."""
    return _NAMES.get(int(code), f"dtype code {code}")


def numpy_dtype(code: DType) -> np.dtype:
    return _NUMPY[DType(code)]


def is_float(code: DType) -> bool:
    return code in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
