"""Device-level helpers that kernel source text calls: float32 <-> uint32 bit casts (bfloat16 is
the top half of a float32), and loads and stores through raw addresses (the fused pack kernel
reaches K tensors through a table of addresses).

On a GPU they are Numba intrinsics, inlined into the kernel as a few LLVM instructions
(``bitcast``; ``inttoptr`` + ``getelementptr`` + ``load``/``store``) -- intrinsics, not jitted
device functions, so compiling to PTX never asks the driver for a device. Under Numba's simulator
kernels run as Python and "device" arrays are host NumPy memory, so the same names are bound to
NumPy/ctypes functions doing the same to host addresses. Kernel bodies are shared; which set
they get is decided when a kernel is built (`build_kernel`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
from ddlcore.kernels.cuda.runtime import numba_cuda, simulated, storage_dtype


def build_kernel(source: str, name: str, label: str, **names: Any) -> Any:
    """Compile-on-first-launch kernel ``name`` defined in ``source``. Its globals are ``cuda``,
    ``np``, the device primitives and ``names``: a namespace of its own, in which Numba's
    simulator can swap ``cuda`` for its thread-index module."""
    cuda = numba_cuda()
    namespace: dict[str, Any] = {"cuda": cuda, "np": np, **bit_casts(), **names}
    exec(compile(source, f"<{label}>", "exec"), namespace)
    return cuda.jit(namespace[name])


def bit_casts() -> dict[str, Callable[..., Any]]:
    """``float32_bits(x) -> uint32`` and ``float32_from_bits(integer) -> float32`` (the integer's
    low 32 bits), for the running backend."""
    return _host_bit_casts() if simulated() else _gpu_bit_casts()


def pointer_access(dtype: np.dtype) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``load(address, index)`` and ``store(address, index, value)`` for elements of ``dtype``
    (bfloat16 as its uint16 bits): element ``index`` of the array starting at byte ``address``."""
    stored = storage_dtype(dtype).str
    return _host_pointer_access(stored) if simulated() else _gpu_pointer_access(stored)


# --- simulator: host memory, plain Python --------------------------------------------------


@functools.cache
def _host_bit_casts() -> dict[str, Callable[..., Any]]:
    def float32_bits(value: Any) -> Any:
        return np.float32(value).view(np.uint32)

    def float32_from_bits(bits: Any) -> Any:
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    return {"float32_bits": float32_bits, "float32_from_bits": float32_from_bits}


@functools.cache
def _host_pointer_access(stored: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    dt = np.dtype(stored)
    size = dt.itemsize

    def load(address: Any, index: Any) -> Any:
        return np.frombuffer(ctypes.string_at(int(address) + int(index) * size, size), dt)[0]

    def store(address: Any, index: Any, value: Any) -> None:
        ctypes.memmove(int(address) + int(index) * size, np.asarray(value, dt).tobytes(), size)

    return load, store


# --- GPU: Numba intrinsics -----------------------------------------------------------------


def _numba_types() -> Any:
    """``numba.cuda.types`` (typed Any: its attributes are made at run time)."""
    return importlib.import_module("numba.cuda.types")


@functools.cache
def _gpu_bit_casts() -> dict[str, Callable[..., Any]]:
    from llvmlite import ir
    from numba.cuda.extending import intrinsic

    types = _numba_types()

    @intrinsic
    def float32_bits(typingctx: Any, value: Any) -> Any:
        if value != types.float32:
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.bitcast(args[0], ir.IntType(32))

        return types.uint32(types.float32), codegen

    @intrinsic
    def float32_from_bits(typingctx: Any, bits: Any) -> Any:
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            word = context.cast(builder, args[0], sig.args[0], types.uint32)
            return builder.bitcast(word, ir.FloatType())

        return types.float32(bits), codegen

    return {"float32_bits": float32_bits, "float32_from_bits": float32_from_bits}


@functools.cache
def _gpu_pointer_access(stored: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
    from numba.cuda.extending import intrinsic
    from numba.cuda.np.numpy_support import from_dtype

    types = _numba_types()
    element = from_dtype(np.dtype(stored))
    align = np.dtype(stored).itemsize

    def element_pointer(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        address = context.cast(builder, args[0], sig.args[0], types.uint64)
        base = builder.inttoptr(address, context.get_data_type(element).as_pointer())
        index = context.cast(builder, args[1], sig.args[1], types.int64)
        return builder.gep(base, [index])

    @intrinsic
    def load(typingctx: Any, address: Any, index: Any) -> Any:
        if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            return builder.load(element_pointer(context, builder, sig, args), align=align)

        return element(address, index), codegen

    @intrinsic
    def store(typingctx: Any, address: Any, index: Any, value: Any) -> Any:
        if not (isinstance(address, types.Integer) and isinstance(index, types.Integer)):
            return None

        def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
            item = context.cast(builder, args[2], sig.args[2], element)
            builder.store(item, element_pointer(context, builder, sig, args), align=align)
            return context.get_dummy_value()

        return types.none(address, index, value), codegen

    return load, store
