"""What the CUDA kernel tests share. Their bodies run in a spawned process (`run_in_process`):
NUMBA_ENABLE_CUDASIM must be set before numba is imported, so the simulator gets a fresh
interpreter, and the same bodies run on a real GPU where there is one. Arrays of any kernel
dtype go to the device with `to_device` (bfloat16 as its uint16 bits, named by `marker`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.harness import run_ranks

SIM = {"NUMBA_ENABLE_CUDASIM": "1"}
GPU = {"NUMBA_ENABLE_CUDASIM": None}
SIZES = [0, 1, 2, 7, 31, 300]  # the simulator runs a Python thread per CUDA thread: keep small
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


def numba_cuda_installed() -> bool:
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        return False
    return True


def _call(rank: int, size: int, body: Callable[[], Any]) -> Any:
    return body()


def run_in_process(body: Callable[[], Any], gpu: bool = False, timeout: float = 300) -> Any:
    """``body()`` in a fresh process on the simulator (or, with ``gpu``, on a real GPU: the test
    is skipped where there is none); returns what it returns."""
    if gpu:
        from ddlcore.device import cuda_usable

        if not cuda_usable():
            pytest.skip("needs a real GPU (the simulator tests cover CI)")
    (result,) = run_ranks(_call, 1, body, env=GPU if gpu else SIM, timeout=timeout)
    return result


def simulated() -> bool:
    from ddlcore.kernels.cuda.runtime import simulated as is_simulated

    return is_simulated()


def marker(dtype: Any) -> str | None:
    """The ``dtype=`` argument the kernels need for arrays of ``dtype``."""
    return "bfloat16" if np.dtype(dtype) == BFLOAT16 else None


def to_device(array: np.ndarray) -> Any:
    from numba import cuda

    return cuda.to_device(array.view(np.uint16) if array.dtype == BFLOAT16 else array)


def empty_device(n: int, dtype: Any) -> Any:
    from numba import cuda

    dt = np.dtype(dtype)
    return cuda.device_array(n, np.uint16 if dt == BFLOAT16 else dt)


def to_host(device_array: Any, dtype: Any) -> np.ndarray:
    return device_array.copy_to_host().view(np.dtype(dtype))


def half_edge_values(dtype: Any) -> np.ndarray:
    """Bit patterns that exercise the rounding: signed zeros, the smallest and largest
    subnormals, the smallest normal, the largest finite, infinities, quiet, signalling and
    negative NaNs with payloads, neighbours of 1 (ties to even), and values whose sums and
    products overflow or underflow."""
    if np.dtype(dtype) == BFLOAT16:
        bits = [
            0x0000,
            0x8000,
            0x0001,
            0x807F,
            0x0080,
            0x7F7F,
            0xFF7F,
            0x7F80,
            0xFF80,
            0x7FC0,
            0x7F81,
            0xFFC1,
            0x3F80,
            0x3F81,
            0xBF80,
            0x3B80,
            0x3C00,
            0x4040,
            0x3DCD,
            0x7F00,
            0x0100,
            0x1F80,
        ]
    else:
        bits = [
            0x0000,
            0x8000,
            0x0001,
            0x83FF,
            0x0400,
            0x7BFF,
            0xFBFF,
            0x7C00,
            0xFC00,
            0x7E00,
            0x7C01,
            0xFE01,
            0x3C00,
            0x3C01,
            0xBC00,
            0x1400,
            0x1000,
            0x4200,
            0x2E66,
            0x7800,
            0x0800,
            0x2000,
        ]
    return np.array(bits, np.uint16).view(dtype)


def same_up_to_nan_payload(got: np.ndarray, want: np.ndarray, zero_sign: bool = True) -> bool:
    """Bit-equal, except that NaNs need only both be NaN (a GPU's arithmetic returns the
    canonical NaN); with ``zero_sign=False`` a zero's sign may differ too."""
    g, w = got.astype(np.float32), want.astype(np.float32)
    nan = np.isnan(w)
    if not np.array_equal(np.isnan(g), nan):
        return False
    keep = ~nan if zero_sign else ~nan & (w != 0)
    if not zero_sign and not np.all(g[~nan & (w == 0)] == 0):
        return False
    return np.array_equal(got[keep].view(np.uint16), want[keep].view(np.uint16))
