"""Point-to-point latency and bandwidth of a transport, next to the same ping-pong over raw sockets.

    python benchmarks/p2p.py [--transport shm,tcp] [--min 1] [--max 256M] [--nchannels 1] [--json F]
    mpiexec -n 2 python benchmarks/p2p.py --transport shm,tcp,ucx,mpi    # adds an mpi4py column

Two ranks on this host play ping-pong: rank 0 sends ``n`` bytes, rank 1 sends them back.
Latency is half the round trip (median over the iterations), bandwidth is ``n`` over that. Every
transport named is measured in the same two processes, size by size, next to a plain TCP socket
(``sendall`` / ``recv_into``, one thread, no tags, no queues: the bound a Python transport over
the kernel's TCP path can approach) and, when started by ``mpiexec``, mpi4py's blocking
Send/Recv (MPICH's shared-memory path). A transport that cannot run in the process is skipped
with a line saying why (under mpiexec with the MPICH wheel, ucx: that MPI's own UCX and ucxx's
cannot share a process). Receive buffers are touched before timing, so page faults of fresh
memory are not counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sizes(lo: int, hi: int) -> list[int]:
    out, n = [], max(lo, 1)
    while n <= hi:
        out.append(n)
        n *= 4
    if lo == 0:
        out.insert(0, 0)
    return out


def iterations(nbytes: int) -> int:
    # Enough round trips to beat timer noise, bounded so the 256 MB point takes seconds.
    return max(3, min(2000, int(2e8 // max(nbytes, 1))))


def _pingpong(rank: int, send: Any, recv: Any, n: int) -> float:
    """Median one-way latency of ``n``-byte ping-pongs (``send(n)``, ``recv(n)`` block)."""
    lat = []
    for _ in range(iterations(n) + 2):
        t0 = time.perf_counter()
        if rank == 0:
            send(n)
            recv(n)
        else:
            recv(n)
            send(n)
        lat.append((time.perf_counter() - t0) / 2)
    return statistics.median(lat[2:])


def _rank(
    rank: int,
    names: list[str],
    nchannels: int,
    host: str,
    port: int,
    points: list[int],
    conn: Any,
    mpi: Any = None,
) -> list[tuple[int, dict[str, float]]]:
    """Measure every transport in ``names``, raw sockets and (under mpiexec) mpi4py, size by
    size in the same two processes, so they share the machine's state."""
    os.environ["DDL_NCHANNELS"] = str(nchannels)
    from ddlcore.transports import load

    names = usable(names, rank)
    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer(host, port) if rank == 0 else None
    client = StoreClient(host, port, 60.0, rank=rank, size=2)
    contexts = {
        name: load(name)().create_context(rank, 2, PrefixStore(client, f"p2p/{name}/"), 60.0)
        for name in names
    }
    pairs = {name: ctx.pair(1 - rank) for name, ctx in contexts.items()}
    buf = np.ones(max(max(points), 1), np.uint8)  # touched: no page faults inside the timing
    view = memoryview(buf)
    raw = _raw_socket(rank, client)
    systems: dict[str, tuple[Any, Any]] = {
        name: (
            lambda n, p=p: p.isend(view[:n], 1).wait(60),
            lambda n, p=p: p.irecv(view[:n], 1).wait(60),
        )
        for name, p in pairs.items()
    }
    systems["raw socket"] = (lambda n: raw.sendall(view[:n]), lambda n: _recv_all(raw, view[:n]))
    if mpi is not None:
        systems["mpi4py"] = (
            lambda n: mpi.Send([view[:n], _byte()], 1 - rank, 7),
            lambda n: mpi.Recv([view[:n], _byte()], 1 - rank, 7),
        )
    results = []
    for n in points:
        row = {}
        for name, (send, recv) in systems.items():
            client.barrier(f"{name} {n}")
            row[name] = _pingpong(rank, send, recv, n)
        results.append((n, row))
    raw.close()
    for ctx in contexts.values():
        ctx.close()
    client.barrier("done")
    client.close()
    if server is not None:
        server.close()
    if conn is not None:
        conn.send(results)
    return results


def usable(names: list[str], rank: int) -> list[str]:
    """The transports of ``names`` that can run in this process (asked after MPI started, when
    it did: the MPICH wheel's own UCX then keeps ucxx's out); rank 0 says why for the others."""
    from ddlcore.transports import available

    status = available()
    for name in names:
        ok, why = status.get(name, (False, "unknown transport"))
        if not ok and rank == 0:
            print(f"# {name}: skipped, unavailable here: {why}", flush=True)
    return [n for n in names if status.get(n, (False, ""))[0]]


def _byte() -> Any:
    from mpi4py import MPI

    return MPI.BYTE


def _raw_socket(rank: int, client: Any) -> socket.socket:
    if rank == 0:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        client.set("raw", str(listener.getsockname()[1]).encode())
        sock, _ = listener.accept()
        listener.close()
    else:
        sock = socket.create_connection(("127.0.0.1", int(client.get("raw"))))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_all(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        got += sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)


def run(names: list[str], points: list[int], nchannels: int) -> list[tuple[int, dict]]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [
        ctx.Process(
            target=_rank,
            args=(r, names, nchannels, "127.0.0.1", port, points, pipes[r][1]),
            daemon=True,
        )
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 600
        while not pipes[0][0].poll(0.5):  # a rank that dies must not hang the benchmark
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                raise SystemExit(f"a rank failed (exit codes {[p.exitcode for p in procs]})")
        results = pipes[0][0].recv()
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return results


def run_under_mpi(names: list[str], points: list[int], nchannels: int) -> list | None:
    """Started by ``mpiexec -n 2``: these two processes are the ranks; mpi4py is measured too."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_size() != 2:
        raise SystemExit("run the MPI comparison with mpiexec -n 2")
    port = None
    if world.Get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = world.bcast(port, root=0)
    results = _rank(world.Get_rank(), names, nchannels, "127.0.0.1", port, points, None, world)
    return results if world.Get_rank() == 0 else None


def _size(text: str) -> int:
    from ddlcore.config import parse_size

    return parse_size(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    ap.add_argument(
        "--transport",
        default="tcp",
        help="comma-separated transports to measure side by side, e.g. shm,tcp,ucx",
    )
    ap.add_argument("--min", type=_size, default=1, help="smallest message in bytes (K/M/G)")
    ap.add_argument(
        "--max",
        type=_size,
        default=256 << 20,
        help="largest message in bytes (K/M/G); sizes step by 4x",
    )
    ap.add_argument("--nchannels", type=int, default=1, help="TCP connections (DDL_NCHANNELS)")
    ap.add_argument("--json", help="write the rows (and the command) to this file")
    args = ap.parse_args(argv)
    names = [n for n in args.transport.split(",") if n]
    points = sizes(args.min, args.max)
    if os.environ.get("PMI_RANK") is not None or os.environ.get("OMPI_COMM_WORLD_RANK"):
        results = run_under_mpi(names, points, args.nchannels)
        if results is None:
            return
    else:
        results = run(names, points, args.nchannels)
    systems = list(results[0][1])
    print(
        f"# ping-pong between 2 ranks on this host (DDL_NCHANNELS={args.nchannels}); "
        "one-way latency = round trip / 2 (median), GB/s = bytes / latency"
    )
    print(f"{'bytes':>12} " + " ".join(f"{name + ' us':>14} {'GB/s':>7}" for name in systems))
    for n, row in results:
        print(
            f"{n:>12} "
            + " ".join(f"{row[name] * 1e6:>14.1f} {n / row[name] / 1e9:>7.3f}" for name in systems)
        )
    if args.json:
        under_mpi = os.environ.get("PMI_RANK") is not None
        launch = ["mpiexec", "-n", "2"] if under_mpi else []
        doc = {
            "command": " ".join([*launch, "python", "benchmarks/p2p.py", *(argv or sys.argv[1:])]),
            "under_mpi": under_mpi,
            "nchannels": args.nchannels,
            "systems": systems,
            "rows": [{"bytes": n, "one_way_s": dict(row)} for n, row in results],
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
