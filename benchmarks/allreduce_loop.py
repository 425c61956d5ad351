"""Back-to-back allreduces of one size, for profiling (``perf record -a -g -- sleep 3`` while it
runs), quick before/after timings of a change, and latency medians beside MPI's: rank 0 prints
the mean and the spread of its calls, ddlcore's and, with ``--mpi``, MPI_Allreduce's (mpi4py,
in the same processes: run it under mpiexec) in alternating blocks. ddl-bench is the full
sweep (it reports means).

    ddlrun -np 2 python benchmarks/allreduce_loop.py 67108864 400
    mpiexec -n 2 python benchmarks/allreduce_loop.py 4096 20000 --mpi --json out.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import numpy as np

import ddlcore


def _timed(run: Callable[[], object], iters: int, barrier: Callable[[], object]) -> np.ndarray:
    for _ in range(max(3, iters // 100)):
        run()
    barrier()
    took = np.empty(iters)
    clock = time.perf_counter
    for i in range(iters):
        start = clock()
        run()
        took[i] = clock() - start
    barrier()
    return took


def _stats(took: np.ndarray) -> dict[str, float]:
    p50, p90, p99 = np.percentile(took, [50, 90, 99]) * 1e6
    return {
        "mean_us": float(took.mean() * 1e6),
        "median_us": float(p50),
        "p90_us": float(p90),
        "p99_us": float(p99),
        "max_us": float(took.max() * 1e6),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nbytes", type=int)
    parser.add_argument("iters", type=int)
    parser.add_argument("--mpi", action="store_true", help="also time MPI_Allreduce (mpi4py)")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per library")
    parser.add_argument("--json", help="write the rank 0 statistics here")
    args = parser.parse_args()
    with ddlcore.init() as comm:
        x = np.random.default_rng(comm.rank).standard_normal(args.nbytes // 4).astype(np.float32)
        y = np.empty_like(x)
        runs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "ddlcore": (lambda: comm.allreduce(x, out=y), comm.barrier)
        }
        if args.mpi:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            runs["mpi"] = (lambda: world.Allreduce(x, y, op=MPI.SUM), world.Barrier)
        blocks = args.blocks if args.mpi else 1
        took: dict[str, list[np.ndarray]] = {name: [] for name in runs}
        for _ in range(blocks):
            for name, (run, barrier) in runs.items():
                took[name].append(_timed(run, args.iters // blocks, barrier))
        stats = {name: _stats(np.concatenate(parts)) for name, parts in took.items()}
        if comm.rank == 0:
            for name, s in stats.items():
                busbw = x.nbytes / (s["mean_us"] * 1e-6) * 2 * (comm.size - 1) / comm.size
                print(
                    f"{name}: {x.nbytes} B x {args.iters}: {s['mean_us']:.1f} us per call "
                    f"(median {s['median_us']:.1f}, p90 {s['p90_us']:.1f}, p99 "
                    f"{s['p99_us']:.1f}, max {s['max_us']:.0f}), busbw {busbw / 1e9:.2f} GB/s"
                )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"nbytes": x.nbytes, "ranks": comm.size, **stats}, f, indent=1)


if __name__ == "__main__":
    main()
