"""Every CPU kernel against kernels/reference.py, bit for bit, on random data: every dtype x op,
sizes 0, 1, small primes and large odd counts; float16/bfloat16 rounding edge cases; aliasing;
avg's division; pack/unpack of 1 .. 1000 arrays."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ddlcore.kernels import reference
from ddlcore.kernels.dtypes import SUPPORTED_DTYPES, dtype_code

from ddlcore import kernels
from ddlcore.ops import Op

OPS = [Op.SUM, Op.PROD, Op.MIN, Op.MAX]
SIZES = [0, 1, 2, 3, 7, 31, 257, 4099, 1_000_003]
DTYPE_IDS = [np.dtype(d).name for d in SUPPORTED_DTYPES]


def rand(dtype, n, seed):
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, n, dtype=dt, endpoint=True)
    return (rng.standard_normal(n) * 4).astype(dt)


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS, ids=[o.name.lower() for o in OPS])
@pytest.mark.parametrize("n", SIZES)
def test_reduce_copy_matches_reference(dtype, op, n):
    a, b = rand(dtype, n, 1), rand(dtype, n, 2)
    want = reference.reduce_ref([a, b], op)
    out = np.empty_like(a)
    kernels.reduce_copy(out.ctypes.data, a.ctypes.data, b.ctypes.data, n, dtype_code(a.dtype), op)
    assert same_bits(out, want)


@pytest.mark.parametrize("op", OPS, ids=[o.name.lower() for o in OPS])
@pytest.mark.parametrize("n", SIZES)
def test_float16_portable_loop_matches_reference(op, n, float16_path):
    """float16 has a vectorised (F16C) and a portable loop; each must match NumPy."""
    a, b = rand(np.float16, n, 5), rand(np.float16, n, 6)
    out = np.empty_like(a)
    kernels.reduce_copy(out.ctypes.data, a.ctypes.data, b.ctypes.data, n, dtype_code(a.dtype), op)
    assert same_bits(out, reference.reduce_ref([a, b], op))


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("op", OPS, ids=[o.name.lower() for o in OPS])
def test_reduce_into_and_aliasing(dtype, op):
    a, b = rand(dtype, 1001, 3), rand(dtype, 1001, 4)
    want = reference.reduce_ref([a, b], op)
    dst = a.copy()
    kernels.reduce_into(dst.ctypes.data, b.ctypes.data, dst.size, dtype_code(a.dtype), op)
    assert same_bits(dst, want)
    second = b.copy()  # dst aliasing the right operand
    kernels.reduce_copy(
        second.ctypes.data, a.ctypes.data, second.ctypes.data, a.size, dtype_code(a.dtype), op
    )
    assert same_bits(second, want)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 300])
def test_avg_finalize(dtype, divisor):
    parts = [rand(dtype, 513, s) for s in range(3)]
    total = reference.reduce_ref(parts, "sum")
    got = total.copy()
    kernels.avg_finalize(got.ctypes.data, got.size, dtype_code(got.dtype), divisor)
    assert same_bits(got, reference.divide_ref(total, divisor))


def test_avg_of_ints_rounds_down():
    got = kernels.reduce_arrays(
        np.array([-7, 7, -1, 5], np.int32), np.array([0, 0, 0, 0], np.int32), "avg", divisor=2
    )
    assert got.tolist() == [-4, 3, -1, 2]
    assert reference.avg_ref(
        [np.array([-7, 7], np.int64), np.array([0, 0], np.int64)]
    ).tolist() == [-4, 3]
    total = np.array([-7, 7, -1, 5, -6], np.int32)
    kernels.avg_finalize(total.ctypes.data, total.size, dtype_code(total.dtype), 2)
    assert total.tolist() == [-4, 3, -1, 2, -3]


# (a, b, floor of their mean) at the limits of each integer type: a sum in the type would wrap
INT_LIMITS = [
    (
        np.int8,
        [100, 127, -128, -128, 127, -1],
        [101, 127, -128, -127, -128, 0],
        [100, 127, -128, -128, -1, -1],
    ),
    (np.uint8, [253, 255, 0, 255], [254, 255, 1, 0], [253, 255, 0, 127]),
    (
        np.int32,
        [2**31 - 1, -(2**31), -(2**31), 2**31 - 2],
        [2**31 - 1, -(2**31), 2**31 - 1, 2**31 - 1],
        [2**31 - 1, -(2**31), -1, 2**31 - 2],
    ),
    (
        np.int64,
        [2**63 - 1, -(2**63), -(2**63), 2**63 - 2, -3],
        [2**63 - 1, -(2**63), 2**63 - 1, 2**63 - 1, 0],
        [2**63 - 1, -(2**63), -1, 2**63 - 2, -2],
    ),
]


@pytest.mark.parametrize("dtype, a, b, want", INT_LIMITS, ids=lambda v: getattr(v, "__name__", ""))
def test_avg_of_ints_at_the_type_limits(dtype, a, b, want):
    a, b = np.array(a, dtype), np.array(b, dtype)
    assert kernels.reduce_arrays(a.copy(), b, "avg").tolist() == want
    assert reference.avg_ref([a, b]).tolist() == want
    three = reference.avg_ref([a, b, b])  # the oracle is exact: Python integers
    assert three.tolist() == [(int(x) + 2 * int(y)) // 3 for x, y in zip(a, b, strict=True)]


@pytest.fixture(params=["fast", "portable"])
def float16_path(request):
    """Run a test with the vectorised (F16C) float16 loops and again with the portable ones."""
    from ddlcore.kernels.cpu import _reduce

    _reduce.force_portable_float16(request.param == "portable")
    yield request.param
    _reduce.force_portable_float16(False)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["float16", "bfloat16"])
def test_half_precision_rounding_edges(dtype, float16_path):
    """All 65536 bit patterns as left operand, with operands that exercise ties, subnormals,
    overflow to inf, NaN and signed zero: equal to NumPy / ml_dtypes bit for bit, except that
    NaN payloads may be quieted and min/max of -0 and +0 may return either zero (NumPy's float16
    and ml_dtypes' bfloat16 disagree there themselves; the kernel keeps the left operand)."""
    every = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    for other in [
        0.0,
        -0.0,
        1.0,
        -1.0,
        3.0e-5,
        6.1e-5,
        65504.0,
        0.3333,
        np.inf,
        np.nan,
        1e-7,
        2.0**-24,
    ]:
        rhs = np.full(every.shape, other, np.float32).astype(dtype)
        for op in OPS:
            want = reference.reduce_ref([every, rhs], op)
            got = np.empty_like(every)
            kernels.reduce_copy(
                got.ctypes.data,
                every.ctypes.data,
                rhs.ctypes.data,
                every.size,
                dtype_code(every.dtype),
                op,
            )
            nan = np.isnan(want.astype(np.float32))
            assert np.array_equal(np.isnan(got.astype(np.float32)), nan), (op, other)
            zero = want.astype(np.float32) == 0
            assert same_bits(got[~nan & ~zero], want[~nan & ~zero]), (op, other)
            assert np.all(got.astype(np.float32)[zero] == 0), (op, other)


def test_unknown_codes_are_rejected():
    a = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="dtype"):
        kernels.reduce_into(a.ctypes.data, a.ctypes.data, 4, 99, 0)
    with pytest.raises(ValueError, match="op"):
        kernels.reduce_into(a.ctypes.data, a.ctypes.data, 4, 2, 4)
    with pytest.raises(ValueError, match="divisor"):
        kernels.avg_finalize(a.ctypes.data, 4, 2, 0)


@pytest.mark.parametrize("k", [1, 2, 100, 1000])
def test_pack_unpack_round_trip(k):
    rng = np.random.default_rng(k)
    dtypes = SUPPORTED_DTYPES
    arrays = [
        rand(dtypes[i % len(dtypes)], int(rng.integers(0, 50)) if i % 7 else 0, i) for i in range(k)
    ]
    flat = kernels.pack_arrays(arrays)
    assert same_bits(flat, reference.pack_ref(arrays))
    outs = [np.empty_like(a) for a in arrays]
    kernels.unpack_arrays(flat, outs)
    for got, want in zip(outs, reference.unpack_ref(flat, arrays), strict=True):
        assert same_bits(got, want)


def test_pack_arrays_refuses_what_it_cannot_copy():
    a = np.arange(10, dtype=np.float32)
    with pytest.raises(ValueError, match=r"arrays\[1\] is not a C-contiguous"):
        kernels.pack_arrays([a, a[::2]])
    with pytest.raises(TypeError, match=r"arrays\[0\] is a list"):
        kernels.pack_arrays([[1, 2]], out=np.empty(8, np.uint8))
    with pytest.raises(ValueError, match="holds 8 bytes, the arrays 40"):
        kernels.pack_arrays([a], out=np.empty(8, np.uint8))
    flat = kernels.pack_arrays([a])
    frozen = a.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match=r"arrays\[0\] is not a writable"):
        kernels.unpack_arrays(flat, [frozen])
    with pytest.raises(ValueError, match="holds 40 bytes, the arrays 80"):
        kernels.unpack_arrays(flat, [np.empty(20, np.float32)])


def test_pack_pointer_api_with_numpy_tables():
    arrays = [np.arange(i + 1, dtype=np.float64) for i in range(10)]
    sizes = np.array([a.nbytes for a in arrays], np.uint64)
    addrs = np.array([a.ctypes.data for a in arrays], np.uint64)
    flat = np.empty(int(sizes.sum()), np.uint8)
    assert kernels.pack(flat.ctypes.data, addrs, sizes) == flat.nbytes
    assert same_bits(flat, reference.pack_ref(arrays))
    with pytest.raises(ValueError, match="srcs"):
        kernels.pack(flat.ctypes.data, addrs[:3], sizes)


def test_copy_bytes_handles_overlap():
    a = np.arange(10, dtype=np.uint8)
    kernels.copy_bytes(a.ctypes.data + 2, a.ctypes.data, 5)
    assert a.tolist() == [0, 1, 0, 1, 2, 3, 4, 7, 8, 9]
