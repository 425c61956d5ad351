"""What every CUDA kernel module shares: ``numba.cuda`` imported on first use, the launch geometry,
the element types the kernels take (bfloat16 travels in uint16/int16 device arrays, named by a
``dtype`` argument), and turning a kernel's source text into a Numba kernel.

Kernel bodies are source text filled in per element type, not calls into jitted device functions:
such a call makes Numba ask the driver for the current device's compute capability, which would
stop `numba.cuda.compile_ptx` working on machines without a GPU (CI). The device-level helpers
the bodies do call (bit casts, loads and stores through raw addresses) are intrinsics, which Numba
inlines without asking (see ``primitives``).
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

THREADS = 256
MAX_BLOCKS = 8192  # x 256 threads: enough to fill an H100 several times over
# Numba's simulator runs a Python thread per CUDA thread; there a grid of 2 x 32 threads, each
# striding over many elements (the same code paths), keeps the tests fast.
SIMULATOR_THREADS = 32
SIMULATOR_MAX_BLOCKS = 2

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
# The element types every kernel takes, by name; bfloat16's device arrays hold its bit patterns.
KERNEL_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
DTYPES: tuple[np.dtype, ...] = tuple(
    BFLOAT16 if n == "bfloat16" else np.dtype(n) for n in KERNEL_DTYPES
)
HALF_DTYPES = (np.dtype(np.float16), BFLOAT16)
# Device arrays that may hold bfloat16 bit patterns (ml_dtypes' own dtype, where an array has it).
_BFLOAT16_CARRIERS = (np.dtype(np.uint16), np.dtype(np.int16), BFLOAT16)
_BFLOAT16_NAMES = ("bfloat16", "bf16")

_cuda: Any = None


def numba_cuda() -> Any:
    """``numba.cuda``, imported on the first call (importing ddlcore.kernels.cuda must not)."""
    global _cuda
    if _cuda is None:
        from numba import cuda

        _cuda = cuda
    return _cuda


def simulated() -> bool:
    """Whether Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1) stands in for a GPU."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


def unusable_reason() -> str | None:
    """Why the kernels cannot run in this process, in one line (None: a GPU, or the simulator,
    is there). Asks the driver once; never raises."""
    try:
        cuda = numba_cuda()
    except ImportError as exc:
        return f"numba-cuda is not installed ({exc}; pip install 'ddlcore[cuda]')"
    try:
        if simulated():
            return None
        cuda.current_context()
        return None
    except Exception as exc:  # CudaSupportError (no driver, no device) and the like
        words = " ".join(str(exc).split())
        for noise in (
            "Error at driver init:",
            "Ensure that a compatible NVIDIA driver is "
            "installed and available on your system path.",
        ):
            words = words.replace(noise, "")
        words = words.strip(" :") or type(exc).__name__
        return f"no usable GPU: {words}"


def launch_config(n: int) -> tuple[int, int]:
    """(blocks, threads) for a grid-stride loop over n elements: one launch covers any n."""
    threads, max_blocks = (
        (SIMULATOR_THREADS, SIMULATOR_MAX_BLOCKS) if simulated() else (THREADS, MAX_BLOCKS)
    )
    return max(1, min(max_blocks, -(-n // threads))), threads


def dtype_names() -> str:
    return ", ".join(KERNEL_DTYPES)


def as_kernel_dtype(dtype: Any, name: str) -> np.dtype:
    """``dtype`` ("bfloat16", "bf16", np.float32, ml_dtypes.bfloat16 ...) as a NumPy dtype the
    kernels take; TypeError naming ``name`` otherwise."""
    if isinstance(dtype, str) and dtype.lower() in _BFLOAT16_NAMES:
        return BFLOAT16
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(
            f"{name}={dtype!r} is not a dtype; the CUDA kernels take {dtype_names()}"
        ) from None
    if dt not in DTYPES:
        raise TypeError(f"{name}={dt} is not a dtype the CUDA kernels take ({dtype_names()})")
    return dt


def element_dtype(stored: Any, marker: Any, name: str, marker_name: str = "dtype") -> np.dtype:
    """The element type of an array whose memory holds ``stored`` elements, ``marker`` (a dtype
    argument, or None) saying what they really are: bfloat16 lives in uint16 or int16 arrays.
    TypeError naming ``name`` / ``marker_name`` when the kernels cannot take it."""
    stored = np.dtype(stored)
    if marker is not None:
        wanted = as_kernel_dtype(marker, marker_name)
        if wanted == BFLOAT16 and stored in _BFLOAT16_CARRIERS:
            return BFLOAT16
        if wanted != stored:
            raise TypeError(
                f"{marker_name}={wanted.name} does not describe {name}, which holds "
                f"{stored}"
                + (" (bfloat16 lives in uint16 or int16 arrays)" if wanted == BFLOAT16 else "")
            )
        return wanted
    if stored in DTYPES:
        return stored
    hint = (
        f"; if it holds bfloat16 bit patterns, pass {marker_name}='bfloat16'"
        if stored in _BFLOAT16_CARRIERS
        else ""
    )
    raise TypeError(f"{name} has dtype {stored}; the CUDA kernels take {dtype_names()}{hint}")


def storage_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a kernel's array argument has for elements of ``dtype`` (bfloat16: uint16)."""
    return np.dtype(np.uint16) if dtype == BFLOAT16 else np.dtype(dtype)


def as_storage(arr: Any, dtype: np.dtype) -> Any:
    """``arr`` viewed with its `storage_dtype` (int16 or ml_dtypes arrays of bfloat16 as uint16),
    so one compiled kernel serves every carrier."""
    want = storage_dtype(dtype)
    return arr if np.dtype(arr.dtype) == want else arr.view(want)


def fill(template: str, **parts: str) -> str:
    """``template`` with each line that is only ``{name}`` replaced by ``parts[name]``, every line
    of it at that line's indentation (so a part can be several statements), and the ``{name}``
    fields of the other lines formatted in place."""
    lines: list[str] = []
    for line in template.splitlines():
        key = line.strip()
        if key.startswith("{") and key.endswith("}") and key[1:-1] in parts:
            indent = line[: len(line) - len(line.lstrip())]
            lines.extend(indent + part for part in parts[key[1:-1]].splitlines())
        else:
            lines.append(line.format(**parts))
    return "\n".join(lines) + "\n"
