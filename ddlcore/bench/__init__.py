"""``ddl-bench``: collective microbenchmarks in nccl-tests' format, with peers in the same run.

    ddlrun -np 2 ddl-bench -b 4K -e 64M -f 2                  # ddlcore allreduce sweep
    mpiexec -n 2 ddl-bench -b 4K -e 64M --compare mpi,gloo    # beside MPI_Allreduce and gloo

Columns are nccl-tests': size, count, type, redop, root, then time(us), algbw, busbw and #wrong for
out-of-place and in-place. time is the slowest rank's mean over ``-n`` iterations after ``-w``
warm-ups, of the collective alone: in place, the input is reset before the loop, not inside it
(the timed calls reduce their own results, as in nccl-tests), and ``-c 1`` checks one more call
from fresh inputs after the timing. algbw = size / time; busbw = algbw x 2(n-1)/n for
allreduce, (n-1)/n for allgather, reduce_scatter, gather, scatter and alltoall, 1 for broadcast
and reduce (nccl-tests' definitions, so numbers compare across tools). Gather, scatter and
alltoall cannot run in place: their in-place columns time them out of place again; reduce's
and gather's results are checked on the root.
``--compare`` runs the same sizes through MPI_Allreduce (mpi4py; the job must be started by
mpiexec) and torch.distributed's gloo backend in the same processes, alternating size by size so
both see the same machine, and prints each peer's busbw and ddlcore's ratio to it. ``--membw``
adds the physical reference: the memory bandwidth with every rank streaming at once, and each
allreduce's busbw as a percentage of the single-copy bound (`single_copy_bound`).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from ddlcore import config
from ddlcore.bench.cases import (
    COLLECTIVES,
    DTYPES,
    Case,
    Row,
    _ddl_ops,
    _device_ops,
    _dtype,
    _time,
    bus_factor,
    memory_bandwidth,
    single_copy_bound,
    sizes,
)
from ddlcore.bench.output import _write_outputs
from ddlcore.bench.peers import PEERS, _GlooPeer, _MpiPeer
from ddlcore.calls import ROOTED
from ddlcore.collectives import Collective


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
        choice = comm.describe(args.collective, args.maxbytes, args.memory)
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
            args.root if args.collective in (*ROOTED, Collective.BROADCAST) else -1,
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
    p.add_argument(
        "-r",
        "--root",
        type=int,
        default=0,
        help="the root rank (broadcast, reduce, gather, scatter)",
    )
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
