"""pytest-benchmark micro-benchmarks of the CPU kernels beside NumPy and the memory bound.

    cd benchmarks && python -m pytest test_kernel_micro.py -s --benchmark-columns=median,ops

Reduce (a = a OP b, every dtype), reduce-copy (c = a + b) and pack/unpack of 1 .. 1000 arrays
(one call for all of them, against NumPy's per-array copies). Each case prints the bytes it moved
(read + written) per second and its fraction of this host's single-thread a+=b bandwidth
(`membw.py`), the bound a rank of a collective works against. The correctness of the same kernels
is tested in tests/kernels/; here they only run.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ddlcore.kernels.dtypes import dtype_code
from membw import measure  # benchmarks/ is the script's directory

from ddlcore import kernels

REDUCE_BYTES = 16 << 20
DTYPES = [
    np.float32,
    np.float64,
    np.float16,
    ml_dtypes.bfloat16,
    np.int8,
    np.uint8,
    np.int32,
    np.int64,
]
PACK_COUNTS = [1, 10, 100, 1000]
PACK_ARRAY_BYTES = 4096  # gradient-bucket sized tensors: the per-array cost dominates


@pytest.fixture(scope="module")
def bound_gbps() -> float:
    return measure(REDUCE_BYTES, 5)["add_GBps"]


def _report(benchmark, what: str, nbytes: int, bound: float) -> None:
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    gbps = nbytes / benchmark.stats.stats.median / 1e9
    benchmark.extra_info.update(GBps=round(gbps, 2), of_bound=round(gbps / bound, 2))
    print(f"\n{what}: {gbps:.2f} GB/s, {gbps / bound:.0%} of a+=b ({bound:.1f} GB/s)")


def _operands(dt, count: int):
    rng = np.random.default_rng(0)
    a = (rng.random(count) * 4 + 0.5).astype(dt)
    b = (rng.random(count) * 4 + 0.5).astype(dt)
    return a, b


@pytest.mark.parametrize("impl", ["ddlcore", "numpy"])
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: np.dtype(d).name)
def test_reduce_sum(benchmark, bound_gbps, dt, impl):
    a, b = _operands(dt, REDUCE_BYTES // np.dtype(dt).itemsize)
    code = dtype_code(a.dtype)
    if impl == "ddlcore":
        benchmark(kernels.reduce_copy, a.ctypes.data, a.ctypes.data, b.ctypes.data, a.size, code, 0)
    else:
        benchmark(np.add, a, b, out=a)
    _report(benchmark, f"{impl} {np.dtype(dt).name} a += b", 3 * a.nbytes, bound_gbps)


@pytest.mark.parametrize("op", ["prod", "min", "max"])
def test_reduce_other_ops_float32(benchmark, bound_gbps, op):
    a, b = _operands(np.float32, REDUCE_BYTES // 4)
    benchmark(kernels.reduce_arrays, a, b, op)
    _report(benchmark, f"ddlcore float32 {op}", 3 * a.nbytes, bound_gbps)


@pytest.mark.parametrize("impl", ["ddlcore", "numpy"])
def test_reduce_copy_float32(benchmark, bound_gbps, impl):
    """The ring's recv-reduce-copy: c = a + b into a third buffer."""
    a, b = _operands(np.float32, REDUCE_BYTES // 4)
    c = np.empty_like(a)
    if impl == "ddlcore":
        benchmark(
            kernels.reduce_copy,
            c.ctypes.data,
            a.ctypes.data,
            b.ctypes.data,
            a.size,
            dtype_code(a.dtype),
            0,
        )
    else:
        benchmark(np.add, a, b, out=c)
    _report(benchmark, f"{impl} float32 c = a + b", 3 * a.nbytes, bound_gbps)


def _arrays(k: int) -> list[np.ndarray]:
    rng = np.random.default_rng(k)
    return [rng.random(PACK_ARRAY_BYTES // 4).astype(np.float32) for _ in range(k)]


@pytest.mark.parametrize("impl", ["ddlcore", "numpy"])
@pytest.mark.parametrize("k", PACK_COUNTS)
def test_pack(benchmark, bound_gbps, k, impl):
    arrays = _arrays(k)
    flat = np.empty(k * PACK_ARRAY_BYTES, np.uint8)
    if impl == "ddlcore":
        benchmark(kernels.pack_arrays, arrays, flat)
    else:
        view = flat.view(np.float32)
        n = PACK_ARRAY_BYTES // 4

        def numpy_pack():
            for i, a in enumerate(arrays):
                view[i * n : (i + 1) * n] = a

        benchmark(numpy_pack)
    _report(benchmark, f"{impl} pack of {k} x {PACK_ARRAY_BYTES} B", 2 * flat.nbytes, bound_gbps)


@pytest.mark.parametrize("impl", ["ddlcore", "numpy"])
@pytest.mark.parametrize("k", PACK_COUNTS)
def test_unpack(benchmark, bound_gbps, k, impl):
    arrays = _arrays(k)
    flat = kernels.pack_arrays(arrays)
    if impl == "ddlcore":
        benchmark(kernels.unpack_arrays, flat, arrays)
    else:
        view = flat.view(np.float32)
        n = PACK_ARRAY_BYTES // 4

        def numpy_unpack():
            for i, a in enumerate(arrays):
                a[...] = view[i * n : (i + 1) * n]

        benchmark(numpy_unpack)
    _report(benchmark, f"{impl} unpack of {k} x {PACK_ARRAY_BYTES} B", 2 * flat.nbytes, bound_gbps)
