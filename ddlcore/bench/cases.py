"""ddl-bench's cases and timing: one (collective, size)'s buffers and closed-form expected result
(`Case`), each system's collective as (reset, run, result) on host or CUDA memory, the timed loop
(`_time`), nccl-tests' bus-bandwidth factor and the memory-bandwidth reference. No printing and no
argument parsing: `ddlcore.bench` drives these.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddlcore.collectives import Collective

COLLECTIVES = tuple(
    c.value for c in Collective if c not in (Collective.BARRIER, Collective.ALLTOALLV)
)  # plain strings for argparse
# The collectives whose result is on the root only (the others' is not checked).
_AT_ROOT = (Collective.REDUCE, Collective.GATHER)
# Timed out of place in the in-place columns too (scatter and alltoall cannot run in place).
_OUT_OF_PLACE = (Collective.GATHER, Collective.SCATTER, Collective.ALLTOALL)
DTYPES: dict[str, Any] = {
    "float": np.float32,
    "float32": np.float32,
    "double": np.float64,
    "float64": np.float64,
    "half": np.float16,
    "float16": np.float16,
    "bfloat16": "bfloat16",
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int": np.int32,
    "int64": np.int64,
}


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    return {
        Collective.ALLREDUCE: 2 * (n - 1) / n,
        Collective.REDUCE_SCATTER: (n - 1) / n,
        Collective.ALLGATHER: (n - 1) / n,
        Collective.BROADCAST: 1.0,
        Collective.REDUCE: 1.0,
        Collective.GATHER: (n - 1) / n,
        Collective.SCATTER: (n - 1) / n,
        Collective.ALLTOALL: (n - 1) / n,
    }[Collective(collective)]


@dataclass
class Row:
    size: int
    count: int
    type: str
    redop: str
    root: int
    time_us: float
    algbw: float
    busbw: float
    wrong: int
    ip_time_us: float
    ip_algbw: float
    ip_busbw: float
    ip_wrong: int
    peers: dict[str, float] = field(default_factory=dict)  # peer -> busbw (GB/s)


def _dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[name])


def sizes(begin: int, end: int, factor: float) -> list[int]:
    out, s = [], begin
    while s <= end:
        out.append(s)
        nxt = int(s * factor)
        s = nxt if nxt > s else s + 1
    return out


class Case:
    """Buffers and expected results of one (collective, size), shared by every system."""

    def __init__(
        self,
        collective: str,
        nbytes: int,
        dtype: np.dtype,
        rank: int,
        size: int,
        op: str,
        root: int,
    ) -> None:
        self.collective, self.rank, self.size, self.op, self.root = collective, rank, size, op, root
        itemsize = dtype.itemsize
        count = nbytes // itemsize
        if collective in (Collective.REDUCE_SCATTER, Collective.ALLTOALL):
            count -= count % size
        self.count = count
        self.checked = collective not in _AT_ROOT or rank == root
        # Small integers, exact in every dtype and under every op for up to 8 ranks.
        pattern = (np.arange(count) % 3 + 1).astype(dtype)
        self.x = (pattern * (rank + 1) if op != "prod" else pattern).astype(dtype)
        if collective in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.REDUCE):
            # Rank r holds pattern * (r + 1) (pattern alone for prod): the reduction in closed
            # form, so the check costs O(n) memory, not a copy per rank (64 MB x 8 ranks).
            base = pattern.astype(np.float64)
            factor = {
                "sum": size * (size + 1) / 2,
                "avg": (size + 1) / 2,
                "min": 1.0,
                "max": float(size),
            }
            full = base**size if op == "prod" else base * factor[op]
            if op == "avg" and dtype.kind in "iu":  # integer avg: the exact mean rounded down
                full = np.floor(full)
            k = count // size
            whole = collective != Collective.REDUCE_SCATTER
            self.expect = full if whole else full[rank * k : (rank + 1) * k]
            self.out = np.empty(count if whole else k, dtype)
        elif collective in (Collective.ALLGATHER, Collective.GATHER):
            self.expect = np.concatenate(
                [pattern.astype(np.float64) * (r + 1) for r in range(size)]
            )
            self.out = np.empty(count * size, dtype)
        elif collective == Collective.SCATTER:  # every rank holds size blocks; root's are sent
            self.x = (np.arange(count * size) % 3 + 1).astype(dtype) * (rank + 1)
            self.expect = self.x[rank * count : (rank + 1) * count].astype(np.float64)
            self.expect *= (root + 1) / (rank + 1)
            self.out = np.empty(count, dtype)
        elif collective == Collective.ALLTOALL:  # block i of the result: rank i's block rank
            k = count // size
            mine = base = pattern[rank * k : (rank + 1) * k].astype(np.float64)
            self.expect = np.concatenate([mine * (r + 1) for r in range(size)]) if k else base
            self.out = np.empty(count, dtype)
        else:
            self.expect = pattern.astype(np.float64) * (root + 1)
            self.out = self.x.copy()

    def wrong(self, got: np.ndarray) -> int:
        if not self.checked:
            return 0
        return int(np.count_nonzero(got.astype(np.float64) != self.expect))

    def nbytes(self) -> int:
        """nccl-tests' size column: the larger of input and output buffer."""
        return max(self.x.nbytes, self.out.nbytes)


# Each system's collective as (reset, run, result): ``reset`` puts the inputs back (in place
# overwrites them) and is called before the timed loop and before the check, never inside the
# loop; ``run`` is the collective alone, which is what the time column measures (as nccl-tests).
Ops = tuple[Callable[[], None], Callable[[], None], Callable[[], np.ndarray]]


def _nothing() -> None:
    pass


def _device_ops(comm, case: Case, in_place: bool) -> Ops:
    """The same collectives on CUDA device arrays (Numba), copied from the host case."""
    from numba import cuda

    c = case.collective
    x = cuda.to_device(case.x)
    out = (
        x
        if in_place and c in (Collective.ALLREDUCE, Collective.BROADCAST, Collective.REDUCE)
        else cuda.to_device(case.out)
    )

    def reset() -> None:
        if c == Collective.BROADCAST or (in_place and c not in _OUT_OF_PLACE):
            out.copy_to_device(case.x)

    def run() -> None:
        if c == Collective.ALLREDUCE:
            comm.allreduce(out if in_place else x, op=case.op, out=out)
        elif c == Collective.REDUCE_SCATTER:
            comm.reduce_scatter(x, op=case.op, out=out)
        elif c == Collective.ALLGATHER:
            comm.allgather(x, out=out)
        elif c == Collective.BROADCAST:
            comm.broadcast(out, root=case.root)
        else:
            _rooted(comm, case, x, out)

    return reset, run, lambda: out.copy_to_host()


def _rooted(comm, case: Case, x: Any, out: Any) -> None:
    """Reduce, gather, scatter or alltoall of ``x`` into ``out`` (host or device arrays)."""
    c, root = case.collective, case.root
    if c == Collective.REDUCE:
        comm.reduce(x, op=case.op, root=root, out=out)
    elif c == Collective.GATHER:
        comm.gather(x, root=root, out=out)
    elif c == Collective.SCATTER:
        comm.scatter(x, root=root, out=out)
    else:
        comm.alltoall(x, out=out)


def _ddl_ops(comm, case: Case, in_place: bool) -> Ops:
    c = case.collective
    if c == Collective.ALLREDUCE:
        buf = case.x.copy() if in_place else case.x
        out = buf if in_place else case.out

        def reset() -> None:
            if in_place:
                buf[...] = case.x

        return reset, lambda: comm.allreduce(buf, op=case.op, out=out), lambda: out
    if c == Collective.REDUCE_SCATTER:
        return (
            _nothing,
            lambda: comm.reduce_scatter(case.x, op=case.op, out=case.out),
            lambda: case.out,
        )
    if c == Collective.ALLGATHER:
        if in_place:  # the input is this rank's block of the output
            k, out = case.count, case.out
            mine = out[case.rank * k : (case.rank + 1) * k]

            def reset_ag() -> None:
                mine[...] = case.x

            return reset_ag, lambda: comm.allgather(mine, out=out), lambda: out
        return _nothing, lambda: comm.allgather(case.x, out=case.out), lambda: case.out
    if c != Collective.BROADCAST:  # in place: reduce only (`_OUT_OF_PLACE`)
        buf = case.x.copy() if in_place and c == Collective.REDUCE else case.x
        out = buf if in_place and c == Collective.REDUCE else case.out

        def reset_rooted() -> None:
            if buf is not case.x:
                buf[...] = case.x

        return reset_rooted, lambda: _rooted(comm, case, buf, out), lambda: out
    buf = case.out

    def reset_bcast() -> None:
        buf[...] = case.x

    return reset_bcast, lambda: comm.broadcast(buf, root=case.root), lambda: buf


def _time(
    comm, run: Callable[[], None], warmup: int, iters: int, reset: Callable[[], None] = _nothing
) -> float:
    """The slowest rank's mean time of ``run`` over ``iters`` calls after ``warmup`` calls;
    ``reset`` once before them, outside the timed loop."""
    reset()
    for _ in range(warmup):
        run()
    comm.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
    elapsed = (time.perf_counter() - t0) / max(1, iters)
    worst = comm.allreduce(np.array([elapsed]), op="max")
    return float(worst[0])


def memory_bandwidth(comm, nbytes: int = 64 << 20, reps: int = 5) -> dict[str, float]:
    """Copy and a += b bandwidth (GB/s, bytes read + written) of one rank while every rank of
    ``comm`` streams at the same time, as they do in a collective: the slowest rank's best of
    ``reps``. The physical reference for collectives on one host."""
    n = nbytes // 4
    a = np.random.default_rng(comm.rank).random(n, np.float32)
    b = np.random.default_rng(comm.rank + 1).random(n, np.float32)
    c = np.empty_like(a)
    best = {"copy": float("inf"), "add": float("inf")}
    for _ in range(reps):
        for name, fn in (("copy", lambda: np.copyto(c, a)), ("add", lambda: np.add(a, b, out=a))):
            comm.barrier()
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    slowest = comm.allreduce(np.array([best["copy"], best["add"]]), op="max")
    return {"copy_GBps": 2 * nbytes / slowest[0] / 1e9, "add_GBps": 3 * nbytes / slowest[1] / 1e9}


def single_copy_bound(collective: str, n: int, add_gbps: float) -> float:
    """The allreduce busbw (GB/s) a single-copy algorithm cannot exceed on one host: each rank
    reads every rank's 1/n slice of the input (n/n of the data), writes its reduced slice, and
    copies the n - 1 other slices of the result, (3n - 1)/n bytes of memory traffic per input
    byte, at the a += b bandwidth; busbw = 2(n - 1)/(3n - 1) x that bandwidth (n = 2: 40%).
    NaN for the other collectives and for one rank."""
    if collective != Collective.ALLREDUCE or n < 2:
        return float("nan")
    return 2 * (n - 1) / (3 * n - 1) * add_gbps
