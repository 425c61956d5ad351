"""CUDA kernels without a GPU: on Numba's simulator against kernels/reference.py (random data,
every op and dtype, odd sizes), and compiled to real PTX for sm_80 and sm_90. Both run in a
spawned process, because NUMBA_ENABLE_CUDASIM must be set before numba is imported."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.harness import require, run_ranks

SIM = {"NUMBA_ENABLE_CUDASIM": "1"}
SIZES = [0, 1, 2, 7, 31, 300]  # the simulator runs a Python thread per CUDA thread


def _numba_cuda() -> bool:
    try:
        import numba.cuda  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(autouse=True)
def _needs_numba_cuda():
    require(_numba_cuda(), "numba-cuda not installed (pip install 'ddlcore[cuda]')")


def _simulated(rank, size):
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference
    from numba import cuda

    from ddlcore.ops import Op
    from tests.kernels.test_cpu_kernels import rand, same_bits

    checked = 0
    for dtype in kcuda.DTYPES:
        for n in SIZES:
            a, b = rand(dtype, n, n + 1), rand(dtype, n, n + 2)
            for op in (Op.SUM, Op.PROD, Op.MIN, Op.MAX):
                want = reference.reduce_ref([a, b], op)
                da, db = cuda.to_device(a), cuda.to_device(b)
                out = cuda.device_array_like(da)
                kcuda.reduce_copy(out, da, db, op)
                assert same_bits(out.copy_to_host(), want), (np.dtype(dtype), n, op)
                kcuda.reduce_into(da, db, op)  # in place, dst aliasing a
                assert same_bits(da.copy_to_host(), want), (np.dtype(dtype), n, op, "into")
                checked += 1
            for divisor in (1, 3, 7):
                d = cuda.to_device(a)
                kcuda.avg_scale(d, divisor)
                assert same_bits(d.copy_to_host(), reference.divide_ref(a, divisor)), (dtype, n)
    try:
        kcuda.reduce_copy(cuda.to_device(np.ones(3, np.complex64)),
                          cuda.to_device(np.ones(3, np.complex64)),
                          cuda.to_device(np.ones(3, np.complex64)))
    except TypeError as exc:
        assert "complex64" in str(exc)
    else:
        raise AssertionError("complex64 accepted")
    return checked


def test_kernels_on_the_simulator():
    (checked,) = run_ranks(_simulated, 1, env=SIM, timeout=300)
    assert checked == 7 * len(SIZES) * 4


def test_kernels_on_a_gpu():
    """The same checks on a real GPU, where there is one (CI has none: the simulator covers it)."""
    from ddlcore.device import cuda_usable

    if not cuda_usable():
        pytest.skip("needs a real GPU (the simulator test covers CI)")
    (checked,) = run_ranks(_simulated, 1, env={"NUMBA_ENABLE_CUDASIM": None}, timeout=600)
    assert checked == 7 * len(SIZES) * 4


def _ptx(rank, size, cc):
    from ddlcore.kernels import cuda as kcuda

    return kcuda.compile_all_ptx(cc)


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm_80", "sm_90"])
def test_every_kernel_compiles_to_ptx(cc):
    (ptx,) = run_ranks(_ptx, 1, cc, env={"NUMBA_ENABLE_CUDASIM": None}, timeout=600)
    assert len(ptx) == 7 * 5  # 4 ops + avg for each dtype
    for name, text in ptx.items():
        assert f".target sm_{cc[0]}{cc[1]}" in text, name
        assert re.search(r"\.entry\s", text), name
    # float16 is rounded from float32 in one conversion, never through float64
    f16 = ptx["reduce_copy_sum_float16"]
    assert "cvt.rn.f16.f32" in f16 and ".f64" not in f16
