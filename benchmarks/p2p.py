"""Point-to-point latency and bandwidth of a transport, next to the same ping-pong over raw sockets.

    python benchmarks/p2p.py [--transport tcp] [--min 1] [--max 256M] [--nchannels 1]

Two spawned ranks on this host play ping-pong: rank 0 sends ``n`` bytes, rank 1 sends them back.
Latency is half the round trip (median over the iterations), bandwidth is ``n`` over that. The
raw column is the same ping-pong over one plain TCP socket (``sendall`` / ``recv_into``, one
thread, no tags, no queues): the bound a Python transport over the same kernel path can approach.
Receive buffers are touched before timing, so page faults of fresh memory are not counted.
"""

from __future__ import annotations

import argparse
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


def _rank(rank: int, transport: str, nchannels: int, host: str, port: int,
          points: list[int], conn: Any) -> None:
    os.environ["DDL_NCHANNELS"] = str(nchannels)
    from ddlcore.transports import load

    from ddlcore.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer(host, port) if rank == 0 else None
    client = StoreClient(host, port, 60.0, rank=rank, size=2)
    ctx = load(transport)().create_context(rank, 2, PrefixStore(client, "p2p/"), 60.0)
    pair = ctx.pair(1 - rank)
    results = []
    biggest = max(points)
    buf = np.ones(max(biggest, 1), np.uint8)  # touched: no page faults inside the timing
    raw = _raw_socket(rank, client)
    for n in points:
        view = memoryview(buf)[:n]
        lat_t, lat_r = [], []
        client.barrier(f"size {n}")
        for _ in range(iterations(n) + 2):
            t0 = time.perf_counter()
            if rank == 0:
                pair.isend(view, 1).wait(60)
                pair.irecv(view, 2).wait(60)
            else:
                pair.irecv(view, 1).wait(60)
                pair.isend(view, 2).wait(60)
            lat_t.append((time.perf_counter() - t0) / 2)
        for _ in range(iterations(n) + 2):
            t0 = time.perf_counter()
            if rank == 0:
                raw.sendall(view)
                _recv_all(raw, view)
            else:
                _recv_all(raw, view)
                raw.sendall(view)
            lat_r.append((time.perf_counter() - t0) / 2)
        results.append((n, statistics.median(lat_t[2:]), statistics.median(lat_r[2:])))
    raw.close()
    ctx.close()
    client.barrier("done")
    client.close()
    if server is not None:
        server.close()
    conn.send(results)


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


def run(transport: str, points: list[int], nchannels: int) -> list[tuple[int, float, float]]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe(duplex=False) for _ in range(2)]
    procs = [ctx.Process(target=_rank, args=(r, transport, nchannels, "127.0.0.1", port, points,
                                             pipes[r][1]), daemon=True) for r in range(2)]
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


def _size(text: str) -> int:
    from ddlcore.config import parse_size

    return parse_size(text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--min", type=_size, default=1)
    ap.add_argument("--max", type=_size, default=256 << 20)
    ap.add_argument("--nchannels", type=int, default=1)
    args = ap.parse_args(argv)
    results = run(args.transport, sizes(args.min, args.max), args.nchannels)
    print(f"# {args.transport} (DDL_NCHANNELS={args.nchannels}) vs raw socket ping-pong, "
          f"2 ranks on this host; latency = round trip / 2 (median)")
    print(f"{'bytes':>12} {'lat(us)':>10} {'GB/s':>8} {'raw lat':>10} {'raw GB/s':>9} "
          f"{'lat/raw':>8}")
    for n, lat, raw in results:
        print(f"{n:>12} {lat * 1e6:>10.1f} {n / lat / 1e9:>8.3f} {raw * 1e6:>10.1f} "
              f"{n / raw / 1e9:>9.3f} {lat / raw:>8.2f}")


if __name__ == "__main__":
    main()
