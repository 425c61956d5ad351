"""Element types the kernels understand, as small integer codes shared by every kernel backend.

The codes are what the Cython (and later CUDA) kernels dispatch on; `dtype_code` maps a NumPy
dtype (including ml_dtypes' bfloat16) to its code, and `numpy_dtype` maps back.
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

SUPPORTED_DTYPES: tuple[np.dtype, ...] = tuple(_NUMPY.values())


def dtype_code(dtype: np.dtype) -> DType | None:
    """The kernel code of a NumPy dtype (native byte order), or None when unsupported."""
    return _CODES.get(np.dtype(dtype))


def numpy_dtype(code: DType) -> np.dtype:
    return _NUMPY[DType(code)]


def is_float(code: DType) -> bool:
    return code in (DType.FLOAT16, DType.BFLOAT16, DType.FLOAT32, DType.FLOAT64)
