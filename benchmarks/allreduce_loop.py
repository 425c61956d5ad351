"""Back-to-back allreduces of one size, for profiling (``perf record -a -g -- sleep 3`` while it
runs), quick before/after timings of a change, and latency medians beside MPI's: rank 0 prints
the mean and the spread of its calls, ddlcore's and, with ``--mpi``, MPI_Allreduce's (mpi4py,
in the same processes: run it under mpiexec) in alternating blocks. ddl-bench is the full
sweep (it reports means).

    ddlrun -np 2 python benchmarks/allreduce_loop.py 67108864 400
    mpiexec -n 2 python benchmarks/allreduce_loop.py 4096 20000 --mpi --json out.json
    mpiexec -n 2 python benchmarks/allreduce_loop.py 4096 20000 --mpi --json quiet.json \
        --busy-json busy.json    # quiet blocks and blocks beside a busy process, alternating

``--place`` decides where the processes run instead of the kernel's scheduler: ``spread`` pins
rank r to the r-th CPU (of those it may use, round robin) and the busy process to the last;
``packed`` pins every rank to the first CPU and the busy process to the last.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

import ddlcore
from ddlcore.bench.output import cpu_model
from ddlcore.job import placement


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


class _BusyProcess:
    """One CPU-bound process beside the job while in the block: what a machine shared with
    another job looks like. Rank 0 starts it, but as a job of its own: in a session of its own
    (under the kernel's autogroups a session shares the CPU as one), on ``cpus`` (not the ones
    a launcher bound rank 0 to)."""

    def __init__(self, rank: int, barrier: Callable[[], object], cpus: set[int]) -> None:
        self.rank, self.barrier, self.cpus = rank, barrier, cpus
        self.proc: subprocess.Popen[bytes] | None = None

    # The busy process dies with rank 0 (PR_SET_PDEATHSIG, SIGKILL), however rank 0 ends, and
    # says when it runs: every busy block starts with it spinning.
    _BUSY = (
        "import ctypes, sys; ctypes.CDLL(None).prctl(1, 9); "
        "sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    )

    def __enter__(self) -> None:
        try:
            if self.rank == 0:
                self.proc = subprocess.Popen(
                    [sys.executable, "-c", self._BUSY],
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                )
                os.sched_setaffinity(self.proc.pid, self.cpus)
                assert self.proc.stdout is not None
                if self.proc.stdout.read(1) != b"x":
                    raise RuntimeError("the busy process did not start")
            self.barrier()
        except BaseException:
            self._stop()
            raise

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self._stop()
        if exc_type is None:  # a failure is not hidden behind a barrier's timeout
            self.barrier()

    def _stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()
            self.proc = None


def _pin(place: str, rank: int) -> tuple[set[int], bool]:
    """Pin this rank as ``--place`` says. Returns the CPUs for the busy process (free: every
    CPU the launcher may use), and whether the launcher bound the ranks (gave this one fewer
    CPUs than it has itself)."""
    given = sorted(placement.launcher_cpus())  # before ddlcore's own pinning, if any
    try:
        launcher = os.sched_getaffinity(os.getppid())
    except OSError:  # the parent is gone or not ours to look at
        launcher = set(given)
    bound = set(given) < launcher
    if place == "free":
        return launcher, bound
    os.sched_setaffinity(0, {given[rank % len(given)] if place == "spread" else given[0]})
    return {given[-1]}, bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("nbytes", type=int)
    parser.add_argument("iters", type=int)
    parser.add_argument("--mpi", action="store_true", help="also time MPI_Allreduce (mpi4py)")
    parser.add_argument("--blocks", type=int, default=4, help="alternating blocks per library")
    parser.add_argument("--json", help="write the rank 0 statistics here")
    parser.add_argument(
        "--busy-json",
        help="also time every block with one busy process beside the job (quiet and busy "
        "blocks alternate) and write those statistics here",
    )
    parser.add_argument(
        "--place",
        choices=["free", "spread", "packed"],
        default="free",
        help="free: the scheduler places the ranks and the busy process; spread: one CPU per "
        "rank, the busy process on the last; packed: every rank on the first CPU, the busy "
        "process on the last",
    )
    args = parser.parse_args()
    with ddlcore.init() as comm:
        pinned = os.sched_getaffinity(0) != placement.launcher_cpus()  # by init (DDL_BIND)
        busy_cpus, bound = _pin(args.place, comm.rank)
        x = np.random.default_rng(comm.rank).standard_normal(args.nbytes // 4).astype(np.float32)
        y = np.empty_like(x)
        runs: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {
            "ddlcore": (lambda: comm.allreduce(x, out=y), comm.barrier)
        }
        if args.mpi:
            from mpi4py import MPI

            world = MPI.COMM_WORLD
            runs["mpi"] = (lambda: world.Allreduce(x, y, op=MPI.SUM), world.Barrier)
        blocks = args.blocks if args.mpi or args.busy_json else 1
        conditions = {"quiet": contextlib.nullcontext}
        if args.busy_json:
            conditions["busy"] = lambda: _BusyProcess(comm.rank, comm.barrier, busy_cpus)
        took = {c: {name: [] for name in runs} for c in conditions}
        for block in range(blocks):
            # Who goes first alternates: the first of a busy block meets a fresh busy process.
            order = list(runs) if block % 2 == 0 else list(reversed(runs))
            for condition, beside in conditions.items():
                with beside():
                    for name in order:
                        run, barrier = runs[name]
                        took[condition][name].append(_timed(run, args.iters // blocks, barrier))
        for condition, path in (("quiet", args.json), ("busy", args.busy_json)):
            if condition not in took:
                continue
            stats = {name: _stats(np.concatenate(parts)) for name, parts in took[condition].items()}
            if comm.rank != 0:
                continue
            for name, st in stats.items():
                busbw = x.nbytes / (st["mean_us"] * 1e-6) * 2 * (comm.size - 1) / comm.size
                print(
                    f"{name}{' (busy)' if condition == 'busy' else ''}: {x.nbytes} B x "
                    f"{args.iters}: {st['mean_us']:.1f} us per call (median "
                    f"{st['median_us']:.1f}, p90 {st['p90_us']:.1f}, p99 {st['p99_us']:.1f}, "
                    f"max {st['max_us']:.0f}), busbw {busbw / 1e9:.2f} GB/s"
                )
            if path:
                with open(path, "w") as f:
                    doc = {
                        "nbytes": x.nbytes,
                        "ranks": comm.size,
                        "cpu": cpu_model(),
                        "place": args.place,
                        "bound": bound,
                        "pinned": pinned and args.place == "free",
                        **stats,
                    }
                    json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
