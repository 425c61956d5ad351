"""Float32 accumulation of float16/bfloat16 on Numba's simulator: widen_copy, reduce_widen and
narrow_copy against kernels/reference.py's accumulate-in-float32-round-once oracles, every op,
both half types, odd sizes, three inputs (so the accumulator is reused in place); bad
arguments."""

from __future__ import annotations

import numpy as np

from ddlcore.ops import Op
from tests.kernels.cuda.helpers import (
    BFLOAT16,
    SIZES,
    empty_device,
    marker,
    run_in_process,
    to_device,
    to_host,
)

OPS = (Op.SUM, Op.PROD, Op.MIN, Op.MAX, Op.AVG)


def _widen_matches_reference() -> int:
    from ddlcore.kernels import cuda as kcuda
    from ddlcore.kernels import reference

    from tests.kernels.test_cpu_kernels import rand, same_bits

    checked = 0
    for dtype in (np.dtype(np.float16), BFLOAT16):
        for n in SIZES:
            parts = [rand(dtype, n, seed) for seed in (n + 1, n + 2, n + 3)]
            for op in OPS:
                acc = empty_device(n, np.float32)
                kcuda.widen_copy(acc, to_device(parts[0]), dtype=marker(dtype))
                assert same_bits(acc.copy_to_host(), parts[0].astype(np.float32)), (dtype, n)
                other = empty_device(n, np.float32)  # dst apart from acc, then in place
                kcuda.reduce_widen(other, acc, to_device(parts[1]), op, dtype=marker(dtype))
                kcuda.reduce_widen(other, other, to_device(parts[2]), op, dtype=marker(dtype))
                want = reference.accumulate_float32_ref(parts, op)
                assert same_bits(other.copy_to_host(), want), (dtype, n, op)
                out = empty_device(n, dtype)
                kcuda.narrow_copy(out, other, 3 if op == Op.AVG else 1, dtype=marker(dtype))
                assert same_bits(to_host(out, dtype), reference.reduce_widened_ref(parts, op)), (
                    dtype,
                    n,
                    op,
                )
                checked += 1
    return checked


def test_widen_and_narrow_on_the_simulator():
    assert run_in_process(_widen_matches_reference) == 2 * len(SIZES) * len(OPS)


def test_accumulating_in_float32_rounds_once():
    """The reference itself: many float16 ones added to 2048 stay at 2048 in float16
    arithmetic (each step rounds back down), but not when accumulated in float32."""
    from ddlcore.kernels import reference

    parts = [np.full(1, 2048, np.float16)] + [np.ones(1, np.float16)] * 8
    assert reference.reduce_ref(parts, "sum")[0] == 2048
    assert reference.reduce_widened_ref(parts, "sum")[0] == 2056


def _bad_arguments() -> bool:
    from ddlcore.kernels import cuda as kcuda

    from tests.kernels.cuda.test_cuda_kernels import _raises

    f32, f64 = to_device(np.ones(3, np.float32)), to_device(np.ones(3, np.float64))
    f16, f16_short = to_device(np.ones(3, np.float16)), to_device(np.ones(2, np.float16))
    u16 = to_device(np.ones(3, np.uint16))
    _raises(lambda: kcuda.widen_copy(f64, f16), TypeError, "dst", "float32")
    _raises(lambda: kcuda.widen_copy(f32, f32), TypeError, "src", "float16 and bfloat16")
    _raises(lambda: kcuda.widen_copy(f32, u16), TypeError, "src", "dtype='bfloat16'")
    _raises(lambda: kcuda.widen_copy(f32, f16_short), ValueError, "src has 2")
    _raises(lambda: kcuda.reduce_widen(f32, f64, f16), TypeError, "acc")
    _raises(lambda: kcuda.reduce_widen(f32, f32, f16, "median"), ValueError, "op")
    _raises(lambda: kcuda.narrow_copy(f16, f32, 0), ValueError, "divisor")
    _raises(lambda: kcuda.narrow_copy(f32, f32), TypeError, "dst")
    _raises(lambda: kcuda.narrow_copy(u16, f16, dtype="bfloat16"), TypeError, "src")
    return True


def test_bad_arguments_raise_naming_the_argument():
    assert run_in_process(_bad_arguments)
