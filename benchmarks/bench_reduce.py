"""CPU reduce kernel throughput vs NumPy and the memory bound.

    python benchmarks/bench_reduce.py [--mib 64]

For each dtype: ``reduce_copy(a, a, b)`` (a = a + b) on two buffers of ``--mib`` MiB, against
``np.add(a, b, out=a)``, in GB/s counting two reads and one write; best of 10 after warm-up.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
from ddlcore.kernels.dtypes import dtype_code
from membw import best_seconds  # benchmarks/ is the script's directory

from ddlcore import kernels

DTYPES = [np.float32, np.float64, np.int8, np.int32, np.int64, ml_dtypes.bfloat16, np.float16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=64)
    args = parser.parse_args()
    print(f"{'dtype':9s} {'ddlcore GB/s':>13s} {'numpy GB/s':>11s}")
    for dt in DTYPES:
        count = (args.mib << 20) // np.dtype(dt).itemsize
        a = np.random.default_rng(0).random(count).astype(dt)
        b = np.random.default_rng(1).random(count).astype(dt)
        code = dtype_code(a.dtype)
        t = best_seconds(
            lambda a=a, b=b, code=code: kernels.reduce_copy(
                a.ctypes.data, a.ctypes.data, b.ctypes.data, a.size, code, 0
            ),
            10,
        )
        tn = best_seconds(lambda a=a, b=b: np.add(a, b, out=a), 10)
        print(
            f"{np.dtype(dt).name:9s} {3 * a.nbytes / t / 1e9:13.1f} {3 * a.nbytes / tn / 1e9:11.1f}"
        )


if __name__ == "__main__":
    main()
