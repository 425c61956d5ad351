"""``ddl-bench``: collective microbenchmarks in nccl-tests' format, with peers in the same run.

    ddlrun -np 2 ddl-bench -b 4K -e 64M -f 2                  # ddlcore allreduce sweep
    mpiexec -n 2 ddl-bench -b 4K -e 64M --compare mpi,gloo    # beside MPI_Allreduce and gloo

Columns are nccl-tests': size, count, type, redop, root, then time(us), algbw, busbw and #wrong for
out-of-place and in-place. time is the slowest rank's mean over ``-n`` iterations after ``-w``
warm-ups, of the collective alone: in place, the input is reset before the loop, not inside it
(the timed calls reduce their own results, as in nccl-tests), and ``-c 1`` checks one more call
from fresh inputs after the timing. algbw = size / time; busbw = algbw x 2(n-1)/n for
allreduce, (n-1)/n for allgather and reduce_scatter, 1 for broadcast (nccl-tests' definitions,
so numbers compare across tools).
``--compare`` runs the same sizes through MPI_Allreduce (mpi4py; the job must be started by
mpiexec) and torch.distributed's gloo backend in the same processes, alternating size by size so
both see the same machine, and prints each peer's busbw and ddlcore's ratio to it. ``--membw``
adds the physical reference: the memory bandwidth with every rank streaming at once, and each
allreduce's busbw as a percentage of the single-copy bound (`single_copy_bound`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from ddlcore import config
from ddlcore.collectives import Collective

COLLECTIVES = tuple(c.value for c in Collective)[:-1]  # no barrier; plain strings for argparse
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
PEERS = ("mpi", "gloo")


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    return {
        Collective.ALLREDUCE: 2 * (n - 1) / n,
        Collective.REDUCE_SCATTER: (n - 1) / n,
        Collective.ALLGATHER: (n - 1) / n,
        Collective.BROADCAST: 1.0,
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
        if collective in (Collective.REDUCE_SCATTER,):
            count -= count % size
        self.count = count
        # Small integers, exact in every dtype and under every op for up to 8 ranks.
        pattern = (np.arange(count) % 3 + 1).astype(dtype)
        self.x = (pattern * (rank + 1) if op != "prod" else pattern).astype(dtype)
        if collective == Collective.ALLREDUCE or collective == Collective.REDUCE_SCATTER:
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
            self.expect = (
                full if collective == Collective.ALLREDUCE else full[rank * k : (rank + 1) * k]
            )
            self.out = np.empty(count if collective == Collective.ALLREDUCE else k, dtype)
        elif collective == Collective.ALLGATHER:
            self.expect = np.concatenate(
                [pattern.astype(np.float64) * (r + 1) for r in range(size)]
            )
            self.out = np.empty(count * size, dtype)
        else:
            self.expect = pattern.astype(np.float64) * (root + 1)
            self.out = self.x.copy()

    def wrong(self, got: np.ndarray) -> int:
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
        if in_place and c in (Collective.ALLREDUCE, Collective.BROADCAST)
        else cuda.to_device(case.out)
    )

    def reset() -> None:
        if in_place or c == Collective.BROADCAST:
            out.copy_to_device(case.x)

    def run() -> None:
        if c == Collective.ALLREDUCE:
            comm.allreduce(out if in_place else x, op=case.op, out=out)
        elif c == Collective.REDUCE_SCATTER:
            comm.reduce_scatter(x, op=case.op, out=out)
        elif c == Collective.ALLGATHER:
            comm.allgather(x, out=out)
        else:
            comm.broadcast(out, root=case.root)

    return reset, run, lambda: out.copy_to_host()


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


class _MpiPeer:
    name = "mpi"

    def __init__(self, comm) -> None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise SystemExit(
                "ddl-bench: --compare mpi needs mpi4py (pip install 'ddlcore[mpi]')"
            ) from None
        self.MPI, self.world = MPI, MPI.COMM_WORLD
        if self.world.Get_size() != comm.size:
            raise SystemExit(
                f"ddl-bench: --compare mpi needs the job started by mpiexec "
                f"(MPI sees {self.world.Get_size()} ranks, ddlcore {comm.size}); "
                f"run: mpiexec -n {comm.size} ddl-bench ..."
            )
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def supports(self, case: Case) -> bool:
        return case.op in self._ops and case.x.dtype.kind != "V" and case.x.dtype != np.float16

    def op(self, case: Case) -> Callable[[], None]:
        w, c = self.world, case.collective
        if c == Collective.ALLREDUCE:
            return lambda: w.Allreduce(case.x, case.out, op=self._ops[case.op])
        if c == Collective.REDUCE_SCATTER:
            return lambda: w.Reduce_scatter_block(case.x, case.out, op=self._ops[case.op])
        if c == Collective.ALLGATHER:
            return lambda: w.Allgather(case.x, case.out)
        return lambda: w.Bcast(case.out, root=case.root)


class _GlooPeer:
    name = "gloo"

    def __init__(self, comm) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise SystemExit(
                "ddl-bench: --compare gloo needs torch (pip install 'ddlcore[torch]')"
            ) from None
        self.torch, self.dist = torch, dist
        import socket

        port = np.zeros(1, np.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1" if comm.nhosts == 1 else "", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, root=0)
        addr = _master_addr()
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{int(port[0])}", rank=comm.rank, world_size=comm.size
        )
        self._ops = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }

    def supports(self, case: Case) -> bool:
        return case.op in self._ops and case.x.dtype.kind != "V"

    def op(self, case: Case) -> Callable[[], None]:
        t, dist, c = self.torch, self.dist, case.collective
        x, out = t.from_numpy(case.x), t.from_numpy(case.out)
        if c == Collective.ALLREDUCE:

            def run() -> None:
                out.copy_(x)
                dist.all_reduce(out, op=self._ops[case.op])

            return run
        if c == Collective.REDUCE_SCATTER:
            return lambda: dist.reduce_scatter_tensor(out, x, op=self._ops[case.op])
        if c == Collective.ALLGATHER:
            return lambda: dist.all_gather_into_tensor(out, x)
        return lambda: dist.broadcast(out, src=case.root)

    def close(self) -> None:
        self.dist.destroy_process_group()


def _master_addr() -> str:
    from ddlcore.rendezvous import detect

    info = detect()
    return info.master_addr or "127.0.0.1"


def _fmt_size(n: int) -> str:
    return f"{n:12d}"


def run(args: argparse.Namespace) -> list[Row]:
    import ddlcore

    if args.memory == "cuda":  # one line, before joining the job, rather than Numba's traceback
        from ddlcore.kernels.cuda import unusable_reason

        reason = unusable_reason()
        if reason is not None:
            raise SystemExit(f"ddl-bench: --memory cuda: {reason}")
    comm = ddlcore.init(transport=args.transport, algo=args.algo)
    dtype = _dtype(args.dtype)
    peers = []
    for name in [p for p in (args.compare or "").split(",") if p]:
        if name not in PEERS:
            raise SystemExit(f"ddl-bench: --compare {name!r}: known peers are {', '.join(PEERS)}")
        peers.append(_MpiPeer(comm) if name == "mpi" else _GlooPeer(comm))
    n = comm.size
    factor = bus_factor(args.collective, n)
    rows: list[Row] = []
    lead = comm.rank == 0
    sweep = sizes(args.minbytes, args.maxbytes, args.stepfactor)
    bound = float("nan")
    membw: dict[str, float] | None = None
    if args.membw:
        membw = memory_bandwidth(comm)
        bound = single_copy_bound(args.collective, n, membw["add_GBps"])
        if lead:
            print(
                f"# memory bandwidth, all {n} ranks streaming at once (64 MiB, bytes read + "
                f"written, per rank): copy {membw['copy_GBps']:.1f} GB/s, a+=b "
                f"{membw['add_GBps']:.1f} GB/s; single-copy allreduce bound {bound:.2f} GB/s "
                "busbw"
            )
    if lead:
        choice = comm.describe(args.collective, args.maxbytes)
        print(
            f"# ddl-bench: {args.collective}, {n} ranks on {comm.nhosts} host(s), "
            f"transport {sorted(set(comm.transports.values())) or ['none']}, algorithm "
            f"{choice.algorithm}, chunk {choice.chunk_bytes} B, dtype {dtype}, op {args.op}, "
            f"{args.memory} memory, "
            f"warmup {args.warmup}, iters {args.iters}"
        )
        peer_head = "".join(f" {p.name + ':busbw':>11s} {'ratio':>6s}" for p in peers)
        peer_head += f" {'%bound':>6s}" if args.membw else ""
        print("#" + " " * 54 + "out-of-place" + " " * 23 + "in-place")
        print(
            f"# {'size':>10s} {'count':>12s} {'type':>8s} {'redop':>6s} {'root':>5s} "
            f"{'time':>9s} {'algbw':>7s} {'busbw':>7s} {'#wrong':>6s} "
            f"{'time':>9s} {'algbw':>7s} {'busbw':>7s} {'#wrong':>6s}{peer_head}"
        )
        print(
            f"# {'(B)':>10s} {'(elements)':>12s} {'':>8s} {'':>6s} {'':>5s} "
            f"{'(us)':>9s} {'(GB/s)':>7s} {'(GB/s)':>7s} {'':>6s} "
            f"{'(us)':>9s} {'(GB/s)':>7s} {'(GB/s)':>7s}"
        )
    for i, nbytes in enumerate(sweep):
        case = Case(args.collective, nbytes, dtype, comm.rank, n, args.op, args.root)
        iters = max(1, args.iters)
        results = []
        for in_place in (False, True):
            reset, op, got = (_device_ops if args.memory == "cuda" else _ddl_ops)(
                comm, case, in_place
            )
            t = _time(comm, op, args.warmup, iters, reset)
            wrong = 0
            if args.check:  # from fresh inputs: in place, the timed calls reduced the results
                reset()
                op()
                wrong = int(comm.allreduce(np.array([case.wrong(got())], np.int64))[0])
            algbw = case.nbytes() / t / 1e9 if t > 0 else 0.0
            results.append((t * 1e6, algbw, algbw * factor, wrong))
        row = Row(
            case.nbytes(),
            case.count,
            str(dtype),
            args.op,
            args.root if args.collective == Collective.BROADCAST else -1,
            *results[0],
            *results[1],
        )
        for peer in peers:
            if peer.supports(case):
                t = _time(comm, peer.op(case), args.warmup, iters)
                row.peers[peer.name] = case.nbytes() / t / 1e9 * factor if t > 0 else 0.0
        rows.append(row)
        if lead:
            peer_cols = ""
            for peer in peers:
                bw = row.peers.get(peer.name)
                ratio = row.busbw / bw if bw else float("nan")
                peer_cols += f" {bw if bw is not None else float('nan'):11.2f} {ratio:6.2f}"
            if args.membw:
                peer_cols += f" {100 * row.busbw / bound:6.0f}"
            print(
                f"  {row.size:10d} {row.count:12d} {row.type:>8s} {row.redop:>6s} {row.root:5d} "
                f"{row.time_us:9.1f} {row.algbw:7.2f} {row.busbw:7.2f} {row.wrong:6d} "
                f"{row.ip_time_us:9.1f} {row.ip_algbw:7.2f} {row.ip_busbw:7.2f} {row.ip_wrong:6d}"
                f"{peer_cols}",
                flush=True,
            )
            if args.progress:
                print(f"\r[{i + 1}/{len(sweep)}] {nbytes} B", end="", file=sys.stderr, flush=True)
    if lead:
        if args.progress:
            print(file=sys.stderr)
        wrong = sum(r.wrong + r.ip_wrong for r in rows)
        print(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        avg = sum(r.busbw for r in rows) / max(1, len(rows))
        print(f"# Avg bus bandwidth    : {avg:.4g}")
        for peer in peers:
            vals = [r.peers[peer.name] for r in rows if peer.name in r.peers]
            if vals:
                print(f"# Avg bus bandwidth {peer.name:5s}: {sum(vals) / len(vals):.4g}")
        _write_outputs(args, rows, n, membw, bound)
    for peer in peers:
        if hasattr(peer, "close"):
            peer.close()
    comm.close()
    return rows


def _write_outputs(
    args: argparse.Namespace, rows: list[Row], n: int, membw: dict[str, float] | None, bound: float
) -> None:
    if args.json:
        doc: dict[str, Any] = {
            "collective": args.collective,
            "nranks": n,
            "rows": [asdict(r) for r in rows],
        }
        if membw is not None:
            doc["memory_bandwidth"] = membw
            doc["single_copy_bound_busbw"] = bound
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    if args.csv:
        with open(args.csv, "w") as f:
            peers = sorted({p for r in rows for p in r.peers})
            f.write(
                "size,count,type,redop,root,time_us,algbw,busbw,wrong,ip_time_us,ip_algbw,"
                "ip_busbw,ip_wrong" + "".join(f",{p}_busbw" for p in peers) + "\n"
            )
            for r in rows:
                vals = [
                    r.size,
                    r.count,
                    r.type,
                    r.redop,
                    r.root,
                    r.time_us,
                    r.algbw,
                    r.busbw,
                    r.wrong,
                    r.ip_time_us,
                    r.ip_algbw,
                    r.ip_busbw,
                    r.ip_wrong,
                ]
                vals += [r.peers.get(p, "") for p in peers]
                f.write(",".join(str(v) for v in vals) + "\n")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("# --plot needs matplotlib (pip install 'ddlcore[plot]')", file=sys.stderr)
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = [r.size for r in rows]
        ax.plot(xs, [r.busbw for r in rows], marker="o", label="ddlcore")
        for p in sorted({p for r in rows for p in r.peers}):
            ax.plot(
                [r.size for r in rows if p in r.peers],
                [r.peers[p] for r in rows if p in r.peers],
                marker="s",
                label=p,
            )
        if membw is not None and bound == bound:
            ax.axhline(bound, color="grey", linestyle="--", label="single-copy memory bound")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(f"{args.collective}, {n} ranks, {args.dtype} {args.op}")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default after its help."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddl-bench", description=__doc__, formatter_class=_HelpFormatter
    )
    p.add_argument(
        "-C",
        "--collective",
        choices=COLLECTIVES,
        default="allreduce",
        help="the collective to time",
    )
    p.add_argument(
        "-b",
        "--minbytes",
        type=config.parse_size,
        default=config.parse_size("8"),
        help="smallest message in bytes (K/M/G suffixes)",
    )
    p.add_argument(
        "-e",
        "--maxbytes",
        type=config.parse_size,
        default=config.parse_size("32M"),
        help="largest message in bytes (K/M/G suffixes)",
    )
    p.add_argument(
        "-f",
        "--stepfactor",
        type=float,
        default=2.0,
        help="multiply the size by this from one row to the next",
    )
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations per size")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations before them")
    p.add_argument(
        "-c",
        "--check",
        type=int,
        default=1,
        help="check results (1) or not (0); checked outside the timed loop",
    )
    p.add_argument(
        "-o",
        "--op",
        choices=("sum", "prod", "min", "max", "avg"),
        default="sum",
        help="reduction op (integer avg: the exact mean rounded down)",
    )
    p.add_argument("-d", "--dtype", choices=sorted(DTYPES), default="float", help="element type")
    p.add_argument("-r", "--root", type=int, default=0, help="broadcast's root rank")
    p.add_argument(
        "--memory",
        choices=("host", "cuda"),
        default="host",
        help="where the buffers live (cuda: Numba device arrays, needs numba-cuda and a GPU)",
    )
    p.add_argument(
        "--transport",
        default=None,
        help="like DDL_TRANSPORT: auto, shm, tcp, mpi, ucx (None: the variable's)",
    )
    p.add_argument(
        "--algo",
        default=None,
        help="like DDL_ALGO: auto, ring, mdring, rhd, rd, direct (None: the variable's)",
    )
    p.add_argument(
        "--compare",
        default="",
        help="peers to time in the same job, comma-separated: mpi (needs mpiexec), "
        "gloo (needs torch)",
    )
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.add_argument("--csv", default=None, help="write the rows as CSV to this file")
    p.add_argument("--plot", default=None, help="draw busbw vs size to this PNG (matplotlib)")
    p.add_argument("--progress", action="store_true", help="progress on stderr")
    p.add_argument(
        "--membw",
        action="store_true",
        help="measure the memory bandwidth with every rank streaming, and print each "
        "allreduce size's busbw as a percentage of the single-copy bound",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.minbytes > args.maxbytes:
        raise SystemExit("ddl-bench: -b must not exceed -e")
    rows = run(args)
    return 1 if any(r.wrong or r.ip_wrong for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
