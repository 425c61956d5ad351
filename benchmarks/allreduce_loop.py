"""Back-to-back allreduces of one size, for profiling (``perf record -a -g -- sleep 3`` while it
runs) and quick before/after timings of a change; ddl-bench is the full sweep.

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
        start = time.perf_counter()
        for _ in range(iters):
            comm.allreduce(x, out=y)
        comm.barrier()
        per_call = (time.perf_counter() - start) / iters
        if comm.rank == 0:
            busbw = x.nbytes / per_call * 2 * (comm.size - 1) / comm.size
            print(f"{x.nbytes} B x {iters}: {per_call * 1e3:.2f} ms per call, "
                  f"busbw {busbw / 1e9:.2f} GB/s")


if __name__ == "__main__":
    main()
