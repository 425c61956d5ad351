"""The reduce kernels without a GPU, on Numba's simulator against kernels/reference.py: random
data, every op and dtype (bfloat16 included, in uint16 and int16 arrays), odd sizes; float16 and
bfloat16 rounding edge cases against the CPU kernels; bad arguments. The same bodies run on a
real GPU where there is one. (PTX for sm_80/sm_90: test_cuda_ptx.py.)"""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np

from ddlcore.ops import Op
from tests.kernels.cuda.helpers import (
    BFLOAT16,
    SIZES,
    empty_device,
    half_edge_values,
    marker,
    run_in_process,
    same_up_to_nan_payload,
    simulated,
    to_device,
    to_host,
)

OPS = (Op.SUM, Op.PROD, Op.MIN, Op.MAX)


def _reduce_matches_reference() -> int:
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference

    from tests.kernels.test_cpu_kernels import rand, same_bits

    checked = 0
    for dtype in kcuda.DTYPES:
        for n in SIZES:
            a, b = rand(dtype, n, n + 1), rand(dtype, n, n + 2)
            for op in OPS:
                want = reference.reduce_ref([a, b], op)
                da, db = to_device(a), to_device(b)
                out = empty_device(n, dtype)
                kcuda.reduce_copy(out, da, db, op, dtype=marker(dtype))
                assert same_bits(to_host(out, dtype), want), (dtype, n, op)
                kcuda.reduce_into(da, db, op, dtype=marker(dtype))  # in place, dst aliasing a
                assert same_bits(to_host(da, dtype), want), (dtype, n, op, "into")
                checked += 1
            for divisor in (1, 3, 7):
                d = to_device(a)
                kcuda.avg_scale(d, divisor, dtype=marker(dtype))
                assert same_bits(to_host(d, dtype), reference.divide_ref(a, divisor)), (dtype, n)
    # bfloat16 in int16 arrays (how PyTorch's bfloat16 tensors reach Numba) and ml_dtypes' name
    a, b = rand(BFLOAT16, 31, 1), rand(BFLOAT16, 31, 2)
    da, db = (to_device(x).view(np.int16) for x in (a, b))
    kcuda.reduce_into(da, db, "sum", dtype=BFLOAT16.type)
    assert same_bits(to_host(da, BFLOAT16), reference.reduce_ref([a, b], "sum"))
    return checked


def test_reduce_on_the_simulator():
    assert run_in_process(_reduce_matches_reference) == 8 * len(SIZES) * len(OPS)


def _half_precision_edges() -> int:
    """Every pair of edge values: equal to the CPU kernels bit for bit (on a GPU, NaN payloads
    may differ: its arithmetic returns the canonical NaN) and to NumPy / ml_dtypes as the CPU
    kernels' own test allows (NaN payloads, and min/max of -0 and +0, may differ there)."""
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference
    from ddlcore.kernels.dtypes import dtype_code

    from ddlcore import kernels

    warnings.simplefilter("ignore", RuntimeWarning)  # NaN and overflow are the point here
    checked = 0
    for dtype in (np.dtype(np.float16), BFLOAT16):
        values = half_edge_values(dtype)
        a, b = np.repeat(values, values.size), np.tile(values, values.size)
        # on the simulator, bfloat16 rounds with the same integer steps on the same host float32
        # arithmetic as the CPU kernels: every bit agrees, but where both operands are NaN
        # (NumPy's scalar add returns the other operand's NaN than C's does)
        exact = simulated() and dtype == BFLOAT16
        one_nan = ~(np.isnan(a.astype(np.float32)) & np.isnan(b.astype(np.float32)))
        for op in OPS:
            out = empty_device(a.size, dtype)
            kcuda.reduce_copy(out, to_device(a), to_device(b), op, dtype=marker(dtype))
            got = to_host(out, dtype)
            cpu = np.empty_like(a)
            kernels.reduce_copy(
                cpu.ctypes.data, a.ctypes.data, b.ctypes.data, a.size, dtype_code(dtype), op
            )
            if exact:
                assert np.array_equal(got[one_nan].view(np.uint16), cpu[one_nan].view(np.uint16)), (
                    dtype,
                    op,
                )
            assert same_up_to_nan_payload(got, cpu), (dtype, op)
            assert same_up_to_nan_payload(
                got, reference.reduce_ref([a, b], op), zero_sign=op in (Op.SUM, Op.PROD)
            ), (dtype, op)
            checked += 1
        for divisor in (2, 3):
            d = to_device(a)
            kcuda.avg_scale(d, divisor, dtype=marker(dtype))
            assert same_up_to_nan_payload(to_host(d, dtype), reference.divide_ref(a, divisor))
    return checked


def test_half_precision_edges_on_the_simulator():
    assert run_in_process(_half_precision_edges) == 2 * len(OPS)


def _raises(fn, exc, *words) -> None:
    try:
        fn()
    except exc as err:
        for word in words:
            assert word in str(err), (str(err), word)
    else:
        raise AssertionError(f"{fn} did not raise {exc.__name__}")


def _bad_arguments() -> bool:
    from ddlcore.kernels import cuda as kcuda

    c64 = to_device(np.ones(3, np.complex64))
    u16 = to_device(np.ones(3, np.uint16))
    f32, f32_short = to_device(np.ones(3, np.float32)), to_device(np.ones(2, np.float32))
    _raises(lambda: kcuda.reduce_copy(c64, c64, c64), TypeError, "dst", "complex64")
    _raises(lambda: kcuda.reduce_into(u16, u16), TypeError, "dst", "dtype='bfloat16'")
    _raises(lambda: kcuda.reduce_into(u16, u16, dtype="float32"), TypeError, "dtype=float32")
    _raises(lambda: kcuda.reduce_into(f32, f32, dtype="bfloat16"), TypeError, "dtype=bfloat16")
    _raises(lambda: kcuda.reduce_into(f32, f32, dtype="complex"), TypeError, "dtype")
    _raises(lambda: kcuda.reduce_into(f32, f32_short), ValueError, "size")
    _raises(lambda: kcuda.reduce_into(f32, u16), ValueError, "dtype")
    _raises(lambda: kcuda.reduce_into(f32, f32, "median"), ValueError, "op")
    _raises(lambda: kcuda.avg_scale(f32, 0), ValueError, "divisor")
    return True


def test_bad_arguments_raise_naming_the_argument():
    assert run_in_process(_bad_arguments)


def _everything_on_a_gpu() -> bool:
    from tests.kernels.cuda import test_cuda_pack, test_cuda_widen

    _reduce_matches_reference()
    _half_precision_edges()
    _bad_arguments()
    test_cuda_widen._widen_matches_reference()
    test_cuda_widen._bad_arguments()
    test_cuda_pack._pack_checks()
    test_cuda_pack._bad_arguments()
    return True


def test_kernels_on_a_gpu():
    """The simulator tests' bodies on a real GPU, where there is one (CI has none)."""
    assert run_in_process(_everything_on_a_gpu, gpu=True, timeout=600)


def test_importing_the_package_does_not_import_numba():
    code = (
        "import sys, ddlcore.kernels.cuda as k; k.describe(); "
        "assert not [m for m in sys.modules if m.startswith('numba')], 'numba imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
