"""How soon the survivors of a SIGKILL, or of a rank that stops answering (SIGSTOP), compute
again (`Communicator.shrink`), and what `Communicator.agree` costs beside MPICH's own
fault-tolerant agreement.

    python benchmarks/elastic_recovery.py --kills 200 --np 4 --json F  # kill -> shrunk, computing
    python benchmarks/elastic_recovery.py --kills 50 --signal stop --json F  # a hang, the same
    python benchmarks/elastic_recovery.py --kills 200 --testbed 4x2 --json F  # over tcp, 2 hosts
    mpiexec -n 4 python benchmarks/elastic_recovery.py --json F        # agree without failures

Without failures (under mpiexec, the same processes): the median time of ddlcore's
``comm.agree(True)``, of mpi4py's ``Comm.Agree`` (MPICH's ``MPIX_Comm_agree``, ULFM's
interface), and, for the floor of any agreement, of a one-integer allreduce through MPICH and
through ddlcore (neither survives a death).

With ``--kills``: each round starts ``--np`` fresh ranks (forked, no MPI, no ``DDL_*``
variable but the rendezvous), which run small allreduces in a loop; a random rank
(rank 0, which serves the store, included) SIGKILLs itself at a random moment and notes the
time (CLOCK_MONOTONIC, shared by the processes of one host). Each survivor catches the
`PeerFailureError`, shrinks, and notes when its first allreduce on the new communicator
returned, checked against NumPy; the round's recovery is the last survivor's. MPICH 5.0's Agree
and Shrink after a death need an MPICH built for fault tolerance, which the wheel is not, so
the kills have no MPI column.

With ``--signal stop`` the victim stops itself (SIGSTOP: its process is alive, its sockets
open, nothing answers): the survivors find it by the heartbeat's silence
(``DDL_HEARTBEAT_TIMEOUT``, 1 s by default), and each round also reports when the last
survivor's collective failed (the exclusion).

With ``--testbed MxH`` each round runs M ranks on each of H emulated hosts (network namespaces
of ``netns_testbed.py``: shm within a host, tcp across; root only), each rank a fresh
interpreter as a launcher starts it, tcp between hosts (``DDL_TRANSPORT=auto:tcp``: where ucxx
is installed, auto would take ucx); the victim writes its kill time to a file of the round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _median_us(fn: Any, iters: int, sync: Any) -> float:
    sync()
    for _ in range(min(50, iters)):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def costs(iters: int) -> dict[str, Any]:
    """Under mpiexec: each operation's median, rank 0's view."""
    from mpi4py import MPI

    import ddlcore

    world = MPI.COMM_WORLD
    comm = ddlcore.init()
    one = np.ones(1, np.int32)
    out = np.empty(1, np.int32)
    rows = {
        "ddlcore agree": _median_us(lambda: comm.agree(True), iters, world.Barrier),
        "MPICH Agree (MPIX_Comm_agree)": _median_us(lambda: world.Agree(1), iters, world.Barrier),
        "MPICH Allreduce, 1 int": _median_us(
            lambda: world.Allreduce(one, out, op=MPI.MIN), iters, world.Barrier
        ),
        "ddlcore allreduce, 1 int": _median_us(
            lambda: comm.allreduce(one, op="min", out=out), iters, world.Barrier
        ),
    }
    comm.close()
    return {"np": world.size, "iters": iters, "median_us": rows, "rank": world.rank}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(
    rank: int, size: int, port: int, victim: int, seed: int, killed: Any, q: Any, how: int
) -> None:
    os.environ.update(
        DDL_RANK=str(rank),
        DDL_SIZE=str(size),
        DDL_MASTER_ADDR="127.0.0.1",
        DDL_MASTER_PORT=str(port),
    )
    import ddlcore

    comm = ddlcore.init()
    x = np.full(1024, rank + 1.0, np.float32)
    for _ in range(20):
        comm.allreduce(x)
    if rank == victim:

        def die() -> None:
            killed.value = time.monotonic()
            os.kill(os.getpid(), how)

        threading.Timer(random.Random(seed).uniform(0.0, 0.2), die).start()
    while True:
        try:
            comm.allreduce(x)
        except ddlcore.PeerFailureError:
            break
    failed = time.monotonic()
    comm = comm.shrink()
    y = comm.allreduce(x)
    done = time.monotonic()
    want = sum(m + 1.0 for m in comm.member_ids)
    q.put((rank, done, bool(np.all(y == want)), comm.size, failed))
    comm.close()


def kills(nprocs: int, rounds: int, seed: int, how: str = "kill") -> dict[str, Any]:
    # Ranks forked from a server that imported what every rank imports (as the tests do):
    # each round then costs a fork, not an interpreter start and ~0.5 s of imports per rank.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["numpy", "ddlcore.bootstrap"])
    rng = random.Random(seed)
    signum = signal.SIGSTOP if how == "stop" else signal.SIGKILL
    rows = []
    for k in range(rounds):
        victim = rng.randrange(nprocs)
        killed = ctx.Value("d", 0.0)
        q = ctx.Queue()
        port = _free_port()
        procs = [
            ctx.Process(
                target=_rank,
                args=(r, nprocs, port, victim, seed * 1000 + k, killed, q, signum),
            )
            for r in range(nprocs)
        ]
        for p in procs:
            p.start()
        seen = [q.get(timeout=120) for _ in range(nprocs - 1)]
        procs[victim].kill()  # a stopped one is still there
        for p in procs:
            p.join(60)
        assert all(ok and n == nprocs - 1 for _, _, ok, n, _ in seen), seen
        rows.append(
            {
                "victim": victim,
                "recovery_s": max(s[1] for s in seen) - killed.value,
                "excluded_s": max(s[4] for s in seen) - killed.value,
            }
        )
        print(
            f"{how} {k}: rank {victim}, failed after {rows[-1]['excluded_s'] * 1e3:.1f} ms, "
            f"computing after {rows[-1]['recovery_s'] * 1e3:.1f} ms",
            file=sys.stderr,
        )
    return {"np": nprocs, "rounds": rounds, "signal": how, "rows": rows}


def _testbed_rank(victim: int, seed: int, folder: str) -> None:
    """One rank of a testbed round (its variables from the testbed): as `_rank`, reporting on
    stdout, the victim's kill time in ``folder``/killed."""
    import ddlcore

    comm = ddlcore.init()
    x = np.full(1024, comm.rank + 1.0, np.float32)
    for _ in range(20):
        comm.allreduce(x)
    if comm.rank == victim:

        def die() -> None:
            with open(os.path.join(folder, "killed"), "w") as f:
                f.write(repr(time.monotonic()))  # one clock: the namespaces share the kernel
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Timer(random.Random(seed).uniform(0.0, 0.2), die).start()
    while True:
        try:
            comm.allreduce(x)
        except ddlcore.PeerFailureError:
            break
    comm = comm.shrink()
    y = comm.allreduce(x)
    done = time.monotonic()
    ok = bool(np.all(y == sum(m + 1.0 for m in comm.member_ids)))
    print(f"done {done!r} {ok} {comm.size}", flush=True)
    comm.close()


def kills_testbed(shape: str, rounds: int, seed: int) -> dict[str, Any]:
    import tempfile

    import netns_testbed as tb

    per_host, hosts = tb.parse_shape(shape)
    size = per_host * hosts
    rng = random.Random(seed)
    rows = []
    with tb.Testbed(hosts) as bed:
        for k in range(rounds):
            victim = rng.randrange(size)
            folder = tempfile.mkdtemp(prefix=f"round{k}-", dir=bed.workdir)
            argv = [os.path.abspath(__file__), "--rank-worker", str(victim), str(seed * 1000 + k)]
            ranks = bed.launch(per_host, [*argv, folder], folder, env={"DDL_TRANSPORT": "auto:tcp"})
            try:
                for r in ranks:
                    r.proc.wait(timeout=120)
            finally:
                tb.kill(ranks)
            with open(os.path.join(folder, "killed")) as f:
                killed = float(f.read())
            seen = [
                line.split()
                for r in ranks
                if r.rank != victim
                for line in open(r.out).read().splitlines()
                if line.startswith("done ")
            ]
            assert len(seen) == size - 1, [r.output() for r in ranks]
            assert all(ok == "True" and int(n) == size - 1 for _, _, ok, n in seen), seen
            rows.append({"victim": victim, "recovery_s": max(float(s[1]) for s in seen) - killed})
            print(
                f"kill {k}: rank {victim}, {rows[-1]['recovery_s'] * 1e3:.1f} ms", file=sys.stderr
            )
    return {"np": size, "rounds": rounds, "signal": "kill", "testbed": shape, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--kills", type=int, default=0, help="kill rounds (no MPI), else costs")
    p.add_argument("--np", type=int, default=4)
    p.add_argument("--signal", choices=("kill", "stop"), default="kill", help="with --kills")
    p.add_argument("--testbed", default=None, help="MxH: M ranks on each of H netns hosts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    command = "python benchmarks/elastic_recovery.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if a.kills and a.testbed:
        doc = kills_testbed(a.testbed, a.kills, a.seed)
    elif a.kills:
        doc = kills(a.np, a.kills, a.seed, a.signal)
    else:
        doc = costs(a.iters)
        if doc.pop("rank"):
            return 0
        command = f"mpiexec -n {doc['np']} " + command
    doc["command"] = command
    doc["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform()}
    print(json.dumps(doc, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-worker"]:
        _testbed_rank(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    sys.exit(main())
