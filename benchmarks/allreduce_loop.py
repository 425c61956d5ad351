"""Back-to-back allreduces of one size, for profiling (``perf record -a -g -- sleep 3`` while it
runs) and quick before/after timings of a change; rank 0 prints the mean and the spread of its
calls. ddl-bench is the full sweep.

    ddlrun -np 2 python benchmarks/allreduce_loop.py 67108864 400
"""

from __future__ import annotations

import sys
import time

import numpy as np

import ddlcore


def main() -> None:
    nbytes, iters = int(sys.argv[1]), int(sys.argv[2])
    with ddlcore.init() as comm:
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        y = np.empty_like(x)
        for _ in range(3):
            comm.allreduce(x, out=y)
        comm.barrier()
        took = np.empty(iters)
        clock = time.perf_counter
        for i in range(iters):
            start = clock()
            comm.allreduce(x, out=y)
            took[i] = clock() - start
        comm.barrier()
        per_call = float(took.mean())
        if comm.rank == 0:
            busbw = x.nbytes / per_call * 2 * (comm.size - 1) / comm.size
            p50, p90, p99 = np.percentile(took, [50, 90, 99]) * 1e3
            print(
                f"{x.nbytes} B x {iters}: {per_call * 1e3:.3f} ms per call (median "
                f"{p50:.3f}, p90 {p90:.3f}, p99 {p99:.3f}, max {took.max() * 1e3:.3f}), "
                f"busbw {busbw / 1e9:.2f} GB/s"
            )


if __name__ == "__main__":
    main()
