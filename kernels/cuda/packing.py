"""Fused pack and unpack: K device tensors into (or out of) one flat device buffer in ONE kernel
launch, for any K and any sizes (0 included), with an optional cast on the way (float32 gradients
travel as float16 or bfloat16 and come back as float32) and an optional scale (avg's 1/size).

How a thread finds its tensor: the launch gets one int64 table, built with NumPy on the host and
uploaded in one copy (into a device buffer cached per stream, grown when too small):

    table = [ src address 0 .. K-1 | dst address 0 .. K-1 | start 0 .. K ]

where start[t] counts the elements before range t (prefix sums; start[K] = total). The grid
strides over the total element count; for element j a thread binary-searches start for the last
range t with start[t] <= j (that skips empty ranges) and copies element j - start[t] of range t.
Neighbouring threads get neighbouring elements of one tensor, so accesses stay coalesced; the
search is at most log2(K) reads of a table small enough to stay in cache, starts after the range
the thread found last (j only grows), and is skipped while j is still inside that range. Pack and unpack are the same kernel: pack's sources are
the tensors and its destinations points in the flat buffer (flat + start[t] elements); unpack's
the other way round.

The kernel reaches memory through raw addresses (pointer loads and stores, ``primitives``), so it
is compiled per (source type, destination type), never per tensor list: plain copies move the
bits of elements of one size (so NaN payloads survive); casts and scaling are per pair of float
types (float16, bfloat16, float32, float64), computed in float32 -- float64 when one side is
float64 -- and rounded once, as ``reference.pack_cast_ref`` does (float64 -> bfloat16 goes through
float32, as ml_dtypes does). Integers are copied, never cast or scaled.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from ddlcore.kernels.cuda import elements
from ddlcore.kernels.cuda.primitives import build_kernel, pointer_access
from ddlcore.kernels.cuda.runtime import (
    BFLOAT16,
    as_kernel_dtype,
    element_dtype,
    fill,
    launch_config,
    numba_cuda,
)

# The tensor search, shared by both kernels: afterwards range t holds element j, at ``index``.
# Only when j has left the range found last (one read): a big tensor costs no search at all.
_FIND_RANGE = """\
if table[2 * k + t + 1] <= j:
    t += 1
    last = k - 1
    while t < last:
        mid = (t + last + 1) >> 1
        if table[2 * k + mid] <= j:
            t = mid
        else:
            last = mid - 1
index = j - table[2 * k + t]"""

_COPY_RANGES_SOURCE = """
def copy_ranges_kernel(table, k, total):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    t = 0
    while j < total:
        {find_range}
        store_dst(table[k + t], index, load_src(table[t], index))
        j += stride
"""

_CAST_RANGES_SOURCE = """
def cast_ranges_kernel(table, k, total, scale, scaled):
    j = cuda.grid(1)
    stride = cuda.gridsize(1)
    s = {work}(scale)
    t = 0
    while j < total:
        {find_range}
        x = {widen}
        if scaled:
            x = x * s
        {narrow}
        store_dst(table[k + t], index, out)
        j += stride
"""

_FLOATS = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))
_BITS: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


@functools.cache
def copy_ranges_kernel(itemsize: int) -> Any:
    """Copy K ranges of ``itemsize``-byte elements, bit for bit (see the module doc)."""
    load, store = pointer_access(_BITS[itemsize])
    source = fill(_COPY_RANGES_SOURCE, find_range=_FIND_RANGE)
    return build_kernel(
        source,
        "copy_ranges_kernel",
        f"copy_ranges_kernel {itemsize} bytes",
        load_src=load,
        store_dst=store,
    )


@functools.cache
def cast_ranges_kernel(src_dtype: str, dst_dtype: str) -> Any:
    """Copy K ranges of float elements converting ``src_dtype`` to ``dst_dtype`` (names in
    KERNEL_DTYPES), multiplied by ``scale`` when ``scaled``; one rounding."""
    src, dst = as_kernel_dtype(src_dtype, "src_dtype"), as_kernel_dtype(dst_dtype, "dst_dtype")
    work = elements.work_type(src, dst)
    source = fill(
        _CAST_RANGES_SOURCE,
        find_range=_FIND_RANGE,
        work=work,
        widen=elements.widen(src, "load_src(table[t], index)", work),
        narrow=elements.narrow(dst, "x", "out"),
    )
    return build_kernel(
        source,
        "cast_ranges_kernel",
        f"cast_ranges_kernel {src.name} -> {dst.name}",
        load_src=pointer_access(src)[0],
        store_dst=pointer_access(dst)[1],
    )


def _kernel_for(src: np.dtype, dst: np.dtype, scale: float | None) -> tuple[Any, tuple[Any, ...]]:
    """The kernel moving ``src`` elements to ``dst`` ones and its arguments after (table, k,
    total); TypeError for what no kernel does."""
    if src == dst and scale is None:
        return copy_ranges_kernel(src.itemsize), ()
    if src in _FLOATS and dst in _FLOATS:
        return cast_ranges_kernel(src.name, dst.name), (
            1.0 if scale is None else scale,
            scale is not None,
        )
    if src == dst:
        raise TypeError(f"scale={scale!r} needs floating-point data, not {src.name}")
    raise TypeError(
        f"cannot cast {src.name} to {dst.name}: the pack kernels cast only between "
        "float16, bfloat16, float32 and float64"
    )


# --- the address table ---------------------------------------------------------------------

_TABLE_LOCK = threading.Lock()  # one table upload + launch at a time: they share the buffer
_TABLES: dict[tuple[int, int], Any] = {}  # (device, stream) -> int64 device buffer
_MAX_CACHED_TABLES = 16


def _stream_key(stream: Any) -> int:
    if not stream:
        return 0
    try:
        return int(stream)  # the handle, same for every wrapper of one stream
    except TypeError:
        return id(stream)


def _device_key(cuda: Any) -> int:
    try:
        return int(cuda.current_context().device.id)
    except Exception:  # simulator
        return 0


def _upload(table: np.ndarray, stream: Any) -> Any:
    """``table`` in the cached device buffer for (current device, ``stream``), one copy,
    ordered on ``stream`` after the launches that read the buffer before."""
    cuda = numba_cuda()
    key = (_device_key(cuda), _stream_key(stream))
    buffer = _TABLES.get(key)
    if buffer is None or buffer.size < table.size:
        if len(_TABLES) >= _MAX_CACHED_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        grown = max(table.size, 2 * (0 if buffer is None else buffer.size), 1024)
        buffer = _TABLES[key] = cuda.device_array(grown, np.int64)
    buffer[: table.size].copy_to_device(table, stream=stream)
    return buffer


def _launch(
    srcs: np.ndarray,
    dsts: np.ndarray,
    starts: np.ndarray,
    kernel: tuple[Any, tuple[Any, ...]],
    stream: Any,
) -> None:
    """One launch copying range t: ``starts[t+1] - starts[t]`` elements from ``srcs[t]`` to
    ``dsts[t]`` (the module doc's table); ``kernel`` as `_kernel_for` returns it."""
    k, total = len(srcs), int(starts[-1])
    if total == 0:
        return
    table = np.concatenate([srcs, dsts, starts])
    blocks, threads = launch_config(total)
    with _TABLE_LOCK:
        device_table = _upload(table, stream)
        function, extra = kernel
        function[blocks, threads, stream](device_table, k, total, *extra)


def _starts(counts: np.ndarray) -> np.ndarray:
    starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=starts[1:])
    return starts


def _scale(scale: Any) -> float | None:
    if scale is None:
        return None
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.integer, np.floating)):
        raise TypeError(f"scale must be a number or None, not {type(scale).__name__}")
    return float(scale)


# --- intake of device arrays ---------------------------------------------------------------


def _array_info(obj: Any, name: str, writable: bool) -> tuple[int, int, np.dtype]:
    """(address, element count, dtype) of a C-contiguous device array: anything with
    ``__cuda_array_interface__``, or a simulator device array (host memory)."""
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None and type(obj).__module__.startswith("numba.cuda.simulator"):
        iface = obj.__array_interface__
    if iface is None:
        raise TypeError(
            f"{name} is a {type(obj).__name__}, not a device array "
            "(anything with __cuda_array_interface__)"
        )
    dtype = np.dtype(iface["typestr"])
    shape = tuple(iface["shape"])
    count = int(np.prod(shape, dtype=np.int64))
    strides = iface.get("strides")
    if count and strides is not None:
        expected, step = [], dtype.itemsize
        for extent in reversed(shape):
            expected.append(step)
            step *= extent
        if any(s != e for s, e, x in zip(strides, reversed(expected), shape, strict=True) if x > 1):
            raise ValueError(f"{name} is not C-contiguous")
    address, readonly = iface["data"]
    if writable and readonly:
        raise ValueError(f"{name} is read-only")
    return int(address or 0), count, dtype


def _intake(
    flat: Any, tensors: Sequence[Any], dtype: Any, flat_dtype: Any, to_flat: bool
) -> tuple[int, np.dtype, np.ndarray, np.ndarray, np.dtype]:
    """Checked (flat address, flat element type, tensor addresses, counts, tensor type)."""
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Sequence):
        raise TypeError(
            f"tensors must be a sequence of device arrays, not {type(tensors).__name__}"
        )
    flat_address, flat_count, flat_stored = _array_info(flat, "flat", writable=to_flat)
    flat_type = element_dtype(flat_stored, flat_dtype, "flat", "flat_dtype")
    addresses = np.empty(len(tensors), np.int64)
    counts = np.empty(len(tensors), np.int64)
    first: np.dtype | None = None
    for i, tensor in enumerate(tensors):
        addresses[i], counts[i], stored = _array_info(tensor, f"tensors[{i}]", not to_flat)
        if first is None:
            first = stored
        elif stored != first:
            raise TypeError(
                f"tensors[{i}] has dtype {stored}, tensors[0] {first}: one call "
                "takes tensors of one dtype"
            )
    tensor_type = (
        element_dtype(first, dtype, "tensors[0]")
        if first is not None
        else flat_type
        if dtype is None
        else as_kernel_dtype(dtype, "dtype")
    )
    total = int(counts.sum())
    if flat_count < total:
        raise ValueError(f"flat holds {flat_count} elements, the tensors {total}")
    return flat_address, flat_type, addresses, counts, tensor_type


# --- public API ----------------------------------------------------------------------------


def pack(
    flat: Any,
    tensors: Sequence[Any],
    scale: float | None = None,
    stream: Any = 0,
    *,
    dtype: Any = None,
    flat_dtype: Any = None,
) -> None:
    """Copy ``tensors`` one after another into ``flat``, cast to ``flat``'s element type and
    multiplied by ``scale`` on the way, in one kernel launch.

    Parameters
    ----------
    flat
        C-contiguous device array (anything with ``__cuda_array_interface__``) of at least the
        tensors' total element count; its element type is the type they are cast to.
    tensors
        C-contiguous device arrays of one dtype, any sizes (0 included), any number (0 included).
    scale
        Multiply every element by this (floats only; e.g. 1/size for avg). None: plain copy.
    stream
        The CUDA stream to launch on (also orders the table upload).
    dtype, flat_dtype
        What the tensors / ``flat`` hold when their own dtype does not say: ``"bfloat16"`` for
        uint16/int16 arrays of bfloat16 bit patterns.

    Raises
    ------
    TypeError
        Not device arrays, tensors of mixed dtypes, a cast other than between float16, bfloat16,
        float32 and float64, or a scale of integers (naming the argument).
    ValueError
        A non-contiguous array, ``flat`` too small or read-only.
    """
    address, flat_type, addresses, counts, tensor_type = _intake(
        flat, tensors, dtype, flat_dtype, True
    )
    pack_addresses(address, addresses, counts, tensor_type, scale, stream, flat_dtype=flat_type)


def unpack(
    flat: Any,
    tensors: Sequence[Any],
    scale: float | None = None,
    stream: Any = 0,
    *,
    dtype: Any = None,
    flat_dtype: Any = None,
) -> None:
    """The inverse of `pack`: split ``flat`` into ``tensors`` (written in place), cast to the
    tensors' element type and multiplied by ``scale`` on the way, in one kernel launch.
    Arguments and errors as in `pack` (here the tensors must be writable)."""
    address, flat_type, addresses, counts, tensor_type = _intake(
        flat, tensors, dtype, flat_dtype, False
    )
    unpack_addresses(address, addresses, counts, tensor_type, scale, stream, flat_dtype=flat_type)


def pack_addresses(
    flat_address: int,
    addresses: Any,
    counts: Any,
    dtype: Any,
    scale: float | None = None,
    stream: Any = 0,
    *,
    flat_dtype: Any = None,
) -> None:
    """`pack` for callers that hold device addresses (e.g. ``torch.Tensor.data_ptr()``):
    range t is ``counts[t]`` elements of type ``dtype`` at ``addresses[t]``; ``flat_address``
    holds elements of ``flat_dtype`` (default ``dtype``). Nothing checks that the memory is
    there: the caller vouches for it."""
    _addresses_launch(flat_address, addresses, counts, dtype, flat_dtype, scale, stream, True)


def unpack_addresses(
    flat_address: int,
    addresses: Any,
    counts: Any,
    dtype: Any,
    scale: float | None = None,
    stream: Any = 0,
    *,
    flat_dtype: Any = None,
) -> None:
    """`unpack` for callers that hold device addresses (see `pack_addresses`)."""
    _addresses_launch(flat_address, addresses, counts, dtype, flat_dtype, scale, stream, False)


def _addresses_launch(
    flat_address: int,
    addresses: Any,
    counts: Any,
    dtype: Any,
    flat_dtype: Any,
    scale: Any,
    stream: Any,
    to_flat: bool,
) -> None:
    tensor_type = as_kernel_dtype(dtype, "dtype")
    flat_type = tensor_type if flat_dtype is None else as_kernel_dtype(flat_dtype, "flat_dtype")
    tensor_addresses = np.asarray(addresses, dtype=np.uint64).reshape(-1).view(np.int64)
    sizes = np.asarray(counts, dtype=np.int64).reshape(-1)
    if sizes.shape != tensor_addresses.shape:
        raise ValueError(f"addresses has {tensor_addresses.size} entries, counts {sizes.size}")
    if sizes.size and sizes.min() < 0:
        raise ValueError("counts must not be negative")
    factor = _scale(scale)
    kernel = (
        _kernel_for(tensor_type, flat_type, factor)
        if to_flat
        else _kernel_for(flat_type, tensor_type, factor)
    )
    starts = _starts(sizes)
    flat_points = np.int64(flat_address) + starts[:-1] * flat_type.itemsize
    if to_flat:
        _launch(tensor_addresses, flat_points, starts, kernel, stream)
    else:
        _launch(flat_points, tensor_addresses, starts, kernel, stream)
