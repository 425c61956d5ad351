"""The one-launch fused pack/unpack on Numba's simulator against kernels/reference.py: K = 0, 1,
2, 7 and 100 tensors of mixed sizes (0-sized ones included), every element type copied bit for
bit, casts to float16/bfloat16 and back with and without a scale, every pair of float types,
round trips, the address-level entry points and ``__cuda_array_interface__`` intake; bad
arguments."""

from __future__ import annotations

import numpy as np

from tests.kernels.cuda.helpers import (
    BFLOAT16,
    empty_device,
    marker,
    run_in_process,
    simulated,
    to_device,
    to_host,
)

COUNTS = (1, 2, 7, 100)
FLOATS = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64))


def _sizes(k: int) -> list[int]:
    """K sizes between 0 and 12, every fifth one 0 (the simulator's threads are Python)."""
    rng = np.random.default_rng(k)
    return [0 if i % 5 == 3 else int(rng.integers(1, 13)) for i in range(k)]


def _tensors(dtype, k: int) -> list[np.ndarray]:
    from tests.kernels.test_cpu_kernels import rand

    return [rand(dtype, n, 100 * k + i) for i, n in enumerate(_sizes(k))]


def _round_trip(arrays, flat_dtype, scale=None, unscale=None) -> int:
    """pack ``arrays`` into a ``flat_dtype`` buffer (one spare element at the end, which must
    stay untouched), compare with the reference, unpack into fresh arrays, compare again."""
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference

    from tests.kernels.test_cpu_kernels import same_bits

    dtype = arrays[0].dtype if arrays else flat_dtype
    total = sum(a.size for a in arrays)
    sentinel = np.full(total + 1, 7, np.float32).astype(flat_dtype)
    flat = to_device(sentinel)
    kcuda.pack(
        flat,
        [to_device(a) for a in arrays],
        scale,
        dtype=marker(dtype),
        flat_dtype=marker(flat_dtype),
    )
    packed = to_host(flat, flat_dtype)
    want = reference.pack_cast_ref(arrays, flat_dtype, scale)
    assert same_bits(packed[:total], want), (dtype, flat_dtype, len(arrays), scale)
    assert same_bits(packed[total:], sentinel[total:]), "pack wrote past the tensors"
    outs = [empty_device(a.size, dtype) for a in arrays]
    kcuda.unpack(flat, outs, unscale, dtype=marker(dtype), flat_dtype=marker(flat_dtype))
    for i, (out, ref) in enumerate(
        zip(outs, reference.unpack_cast_ref(packed, arrays, unscale), strict=True)
    ):
        assert same_bits(to_host(out, dtype), ref), (dtype, flat_dtype, len(arrays), i)
    return 1


def _pack_checks() -> int:
    from ddlcore.kernels import cuda as kcuda

    from tests.kernels.test_cpu_kernels import rand

    checked = 0
    for k in COUNTS:
        f32 = _tensors(np.float32, k)
        checked += _round_trip(f32, np.dtype(np.float32))  # plain copy
        checked += _round_trip(f32, np.dtype(np.float32), 0.25, 4.0)  # scale only
        checked += _round_trip(f32, np.dtype(np.float16), 0.125, 8.0)  # cast and scale
        checked += _round_trip(f32, np.dtype(np.float16))
        checked += _round_trip(f32, BFLOAT16, 1 / 3, 3.0)
        checked += _round_trip(f32, BFLOAT16)
    for dtype in kcuda.DTYPES:  # every element type, copied bit for bit
        checked += _round_trip(_tensors(dtype, 7), dtype)
    for src in FLOATS:  # every cast, both ways, with and without a scale
        for dst in FLOATS:
            checked += _round_trip(_tensors(src, 7), dst)
            checked += _round_trip(_tensors(src, 7), dst, 0.5, 3.0)
    # ranges longer than the grid: a thread meets the same tensor again, past empty ones
    long = [rand(np.float32, n, n) for n in (0, 200, 3, 150, 0, 1, 0)]
    checked += _round_trip(long, BFLOAT16, 0.5, 2.0)
    checked += _round_trip([], np.dtype(np.float32))  # K = 0
    checked += _round_trip([np.empty(0, np.float16)] * 3, np.dtype(np.float32), 2.0)  # all empty
    checked += _addresses_and_interfaces()
    return checked


class _Interface:
    """A device array known only by its ``__cuda_array_interface__`` (as CuPy and PyTorch
    tensors are); on the simulator, "device" memory is host memory, so a NumPy array's serves."""

    def __init__(self, array: np.ndarray, readonly: bool = False) -> None:
        self.array = array
        self.__cuda_array_interface__ = {
            "shape": array.shape,
            "typestr": array.dtype.str,
            "strides": array.strides,
            "data": (array.ctypes.data, readonly),
            "version": 3,
        }


def _addresses_and_interfaces() -> int:
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference

    from tests.kernels.test_cpu_kernels import rand, same_bits

    arrays = [rand(np.float32, n, n) for n in (3, 0, 5)]
    devices = [to_device(a) for a in arrays]
    flat = empty_device(8, BFLOAT16)
    addresses = [
        d.__cuda_array_interface__["data"][0] if not simulated() else d.ctypes.data for d in devices
    ]
    flat_address = flat.__cuda_array_interface__["data"][0] if not simulated() else flat.ctypes.data
    kcuda.pack_addresses(flat_address, addresses, [3, 0, 5], "float32", 2.0, flat_dtype="bfloat16")
    assert same_bits(to_host(flat, BFLOAT16), reference.pack_cast_ref(arrays, BFLOAT16, 2.0))
    back = [empty_device(a.size, np.float32) for a in arrays]
    back_addresses = [
        b.__cuda_array_interface__["data"][0] if not simulated() else b.ctypes.data for b in back
    ]
    kcuda.unpack_addresses(
        flat_address, back_addresses, [3, 0, 5], np.float32, flat_dtype="bfloat16"
    )
    for got, want in zip(
        back, reference.unpack_cast_ref(to_host(flat, BFLOAT16), arrays), strict=True
    ):
        assert same_bits(got.copy_to_host(), want)
    if not simulated():
        return 1
    # 2-D C-contiguous tensors described only by the interface, int16 holding bfloat16
    host = [rand(BFLOAT16, 6, 1).reshape(2, 3), rand(BFLOAT16, 4, 2).reshape(4, 1)]
    flat32 = np.zeros(10, np.float32)
    kcuda.pack(_Interface(flat32), [_Interface(h.view(np.int16)) for h in host], dtype="bf16")
    assert same_bits(flat32, reference.pack_cast_ref(host, np.float32))
    return 2


def test_pack_and_unpack_on_the_simulator():
    checked = run_in_process(_pack_checks)
    assert checked == len(COUNTS) * 6 + 8 + 2 * len(FLOATS) ** 2 + 3 + 2


def _bad_arguments() -> bool:
    from ddlcore.kernels import cuda as kcuda

    from tests.kernels.cuda.test_cuda_kernels import _raises

    f32 = [to_device(np.ones(3, np.float32)), to_device(np.ones(2, np.float32))]
    flat = empty_device(5, np.float32)
    _raises(lambda: kcuda.pack(flat, f32[0]), TypeError, "tensors must be a sequence")
    _raises(
        lambda: kcuda.pack(flat, [np.ones(3, np.float32)]),
        TypeError,
        "tensors[0]",
        "not a device array",
    )
    _raises(lambda: kcuda.pack(np.ones(5), f32), TypeError, "flat")
    _raises(lambda: kcuda.pack(flat, [f32[0], to_device(np.ones(2))]), TypeError, "tensors[1]")
    _raises(lambda: kcuda.pack(empty_device(4, np.float32), f32), ValueError, "flat holds 4")
    strided = to_device(np.ones(8, np.float32))[::2]
    _raises(lambda: kcuda.pack(flat, [strided]), ValueError, "tensors[0]", "contiguous")
    ints = [to_device(np.ones(3, np.int32))]
    _raises(lambda: kcuda.pack(empty_device(3, np.float32), ints), TypeError, "cannot cast")
    _raises(lambda: kcuda.pack(empty_device(3, np.int64), ints), TypeError, "cannot cast")
    _raises(lambda: kcuda.pack(empty_device(3, np.int32), ints, 0.5), TypeError, "scale")
    _raises(lambda: kcuda.pack(flat, f32, "half"), TypeError, "scale")
    _raises(
        lambda: kcuda.pack(flat, [to_device(np.ones(3, np.uint16))]),
        TypeError,
        "tensors[0]",
        "dtype='bfloat16'",
    )
    _raises(lambda: kcuda.pack(flat, f32, flat_dtype="int8"), TypeError, "flat_dtype=int8")
    _raises(lambda: kcuda.pack_addresses(0, [0, 0], [1], "float32"), ValueError, "counts")
    _raises(lambda: kcuda.pack_addresses(0, [0], [-1], "float32"), ValueError, "negative")
    _raises(lambda: kcuda.pack_addresses(0, [0], [1], "complex64"), TypeError, "dtype")
    if simulated():
        frozen = np.ones(3, np.float32)
        _raises(
            lambda: kcuda.unpack(flat, [_Interface(frozen, readonly=True)]),
            ValueError,
            "tensors[0]",
            "read-only",
        )
    return True


def test_bad_arguments_raise_naming_the_argument():
    assert run_in_process(_bad_arguments)
