"""Time of `ddlcore.init()` on this host: how long joining a job takes, rendezvous included.

    python benchmarks/init_time.py [--np 2,4] [--cycles 30] [--transport auto] [--connects 300]
                                   [--store-only] [--probe auto] [--netns 2x2 --rate 1gbit]

Each world size runs in fresh processes (spawned, not forked). The ranks join once (not timed:
imports and the first connection to rank 0's store), then ``cycles`` times: meet at a barrier,
close, and time a fresh `ddlcore.init()` (the same store on rank 0, a new communicator, its
transports connected as init connects them). The barrier first lines the ranks up, so the time
is init's, not the launch skew between processes. Printed per world size: the median and the
minimum over cycles of the slowest rank's time.

``--store-only`` times only init's part at the rendezvous store, the part authentication and the
store's server change: connect (and handshake), publish a record, barrier, read every rank's
record, barrier, close; the ranks line up at a barrier on a second connection first.

``--probe auto|1|0`` sets DDL_LINK_PROBE in the ranks (the link probe at init: by default only
when the job spans hosts). ``--netns 2x2 [--rate 1gbit]`` runs the ranks on the testbed of
``benchmarks/netns_testbed.py`` instead (M ranks in each of H network namespaces, block
placement; root), the job spanning hosts.

``--connects N`` also times what one rank's store connection costs alone (connect, the job-key
handshake, one request, close) against a store server in the same process, N times.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _store_rank(rank: int, size: int, port: int, cycles: int, out) -> None:
    """init's conversation with the store, alone (see ``bootstrap.init``)."""
    from ddlcore.job.store import StoreClient, StoreServer

    server = StoreServer("127.0.0.1", port) if rank == 0 else None
    line = StoreClient("127.0.0.1", port, 120.0, rank=rank, size=size)
    times = []
    for c in range(cycles):
        line.barrier("line up")
        t0 = time.perf_counter()
        client = StoreClient("127.0.0.1", port, 120.0, rank=rank, size=size)
        client.set(f"{c}/peer/{rank}", b"host-id\nshm,tcp\nrack")
        client.barrier(f"{c}/init")
        for r in range(size):
            client.get(f"{c}/peer/{r}")
        client.barrier(f"{c}/peers")
        client.close()
        times.append(time.perf_counter() - t0)
    line.barrier("done")
    line.close()
    if server is not None:
        server.close(linger=10)
    import ddlcore

    out.send((rank, times, ddlcore.__file__))
    out.close()


def _timed_inits(cycles: int) -> list[float]:
    import ddlcore

    comm = ddlcore.init(timeout=120)
    times = []
    for _ in range(cycles):
        comm.barrier()
        comm.close()
        t0 = time.perf_counter()
        comm = ddlcore.init(timeout=120)
        times.append(time.perf_counter() - t0)
    comm.barrier()
    comm.close()
    return times


def _rank(rank: int, size: int, port: int, cycles: int, transport: str, out) -> None:
    os.environ.update(
        {
            "DDL_RANK": str(rank),
            "DDL_SIZE": str(size),
            "DDL_LOCAL_RANK": str(rank),
            "DDL_LOCAL_SIZE": str(size),
            "DDL_MASTER_ADDR": "127.0.0.1",
            "DDL_MASTER_PORT": str(port),
            "DDL_TRANSPORT": transport,
        }
    )
    import ddlcore

    times = _timed_inits(cycles)
    out.send((rank, times, ddlcore.__file__))
    out.close()


def measure(
    size: int, cycles: int, transport: str, store_only: bool = False
) -> tuple[list[float], str]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    pipes, procs = [], []
    for rank in range(size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        proc = (
            ctx.Process(target=_store_rank, args=(rank, size, port, cycles, send_end))
            if store_only
            else ctx.Process(target=_rank, args=(rank, size, port, cycles, transport, send_end))
        )
        proc.start()
        send_end.close()
        pipes.append(recv_end)
        procs.append(proc)
    per_rank, where = {}, ""
    for pipe in pipes:
        if not pipe.poll(600):
            raise SystemExit("a rank did not report within 600 s")
        rank, times, where = pipe.recv()
        per_rank[rank] = times
    for proc in procs:
        proc.join(30)
    slowest = [max(per_rank[r][c] for r in range(size)) for c in range(cycles)]
    return slowest, where


def measure_netns(shape: str, rate: str | None, cycles: int, transport: str) -> list[float]:
    """`measure` on the netns testbed: the ranks print their times, read from their logs."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns_testbed.py")
    spec = importlib.util.spec_from_file_location("netns_testbed", path)
    assert spec and spec.loader
    netns = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netns_testbed", netns)
    spec.loader.exec_module(netns)
    per_host, hosts = netns.parse_shape(shape)
    with netns.Testbed(hosts, rate=rate) as tb:
        ranks = tb.run_job(
            per_host,
            [os.path.abspath(__file__), "--netns-rank", str(cycles)],
            timeout=600,
            env={"DDL_TRANSPORT": transport, "DDL_LINK_PROBE": os.environ["DDL_LINK_PROBE"]},
        )
        per_rank = [json.loads(r.output().strip().splitlines()[-1]) for r in ranks]
    return [max(times[c] for times in per_rank) for c in range(cycles)]


def store_connects(n: int) -> list[float]:
    from ddlcore.job.store import StoreClient, StoreServer

    times = []
    with StoreServer("127.0.0.1", 0) as server:
        for _ in range(n):
            t0 = time.perf_counter()
            with StoreClient("127.0.0.1", server.port, 10.0, rank=0, size=1) as client:
                client.check("k")
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--cycles", type=int, default=30)
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--connects", type=int, default=0)
    parser.add_argument("--store-only", action="store_true")
    parser.add_argument("--probe", default="auto", help="DDL_LINK_PROBE of the ranks")
    parser.add_argument("--netns", help="run on the netns testbed, this shape (MxH)")
    parser.add_argument("--rate", default="1gbit", help="the testbed's link rate, or none")
    parser.add_argument("--netns-rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.netns_rank is not None:  # one rank on the testbed: print its times
        import json

        print(json.dumps(_timed_inits(args.netns_rank)))
        return
    os.environ["DDL_LINK_PROBE"] = args.probe  # spawned ranks inherit it
    if args.netns:
        times = measure_netns(
            args.netns, None if args.rate == "none" else args.rate, args.cycles, args.transport
        )
        print(
            f"{args.netns} at {args.rate}, DDL_TRANSPORT={args.transport}, DDL_LINK_PROBE="
            f"{args.probe}: init median {statistics.median(times) * 1e3:.2f} ms, min "
            f"{min(times) * 1e3:.2f} ms (slowest rank, {args.cycles} inits)"
        )
        return
    if args.connects:
        times = store_connects(args.connects)
        print(
            f"store connection (connect, handshake, one request, close): median "
            f"{statistics.median(times) * 1e3:.3f} ms, min {min(times) * 1e3:.3f} ms "
            f"over {args.connects}"
        )
    print(
        f"{'np':>3} {'transport':>9} {'median ms':>10} {'min ms':>8}  (slowest rank, "
        f"{args.cycles} inits)"
    )
    where = ""
    for size in (int(n) for n in args.np.split(",")):
        times, where = measure(size, args.cycles, args.transport, args.store_only)
        what = "store" if args.store_only else args.transport
        print(
            f"{size:>3} {what:>9} {statistics.median(times) * 1e3:>10.2f} {min(times) * 1e3:>8.2f}"
        )
    print(f"ddlcore from {os.path.dirname(where)}")


if __name__ == "__main__":
    main()
