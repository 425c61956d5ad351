"""Emulated multi-host testbed: N "hosts" as Linux network namespaces on this one machine.

A "switch" namespace holds a Linux bridge; each host namespace is joined to it by a veth pair
whose two ends are both rate-shaped with ``tc ... tbf`` (so each host's link is limited in and
out). ``--adapters A`` gives each host A such links (network adapters, rails): eth0, eth1, ...,
each on its own bridge and subnet (10.213.<rail>.<host+1>), with DDL_SOCKET_IFNAME=eth0,eth1,...
so local rank i sends through eth(i mod A). M ranks per host run this file's `worker` (ddl-bench's timing, in O(n) memory) inside their
host's namespace, so ranks of one host talk over shm and ranks of different hosts over TCP
through the shaped links. ``--placement`` says which ranks share a host: ``block`` puts rank r on
host r // M (ranks host by host, ``mpiexec --map-by slot``), ``cyclic`` on host r % H (dealt
round-robin, Slurm ``--distribution=cyclic``, ``mpiexec --map-by node``): there the rank-order
ring (``DDL_ALGO=ring``) crosses hosts at every hop, as a topology-oblivious ring does. It prints
time and busbw per (shape, placement, rate, algorithm, size) beside the inter-host link bound and
the simulator's prediction for the same rank -> host map (`simulated`). Root only; everything it creates is
named ``ddltb-<pid>-...`` and torn down at the end, also on errors, Ctrl-C, SIGTERM and
``--timeout``.

Limits: link DELAY is not emulated -- ``netem`` is not available in this kernel ("Specified qdisc
kind is unknown"), so only the rate is shaped and latency is the veth's (microseconds). All hosts
share this machine's CPU cores and memory bandwidth, so at high rates the CPU, not the link, is
the limit (the measured/bound ratio shows it).

    python benchmarks/netns_testbed.py --shapes 2x2,2x3,4x2 --rates 1gbit,10gbit \\
        --sizes 1M,4M,16M,64M --algos ring,mdring,rhd --placement block,cyclic --repeat 3 \\
        --json benchmarks/results/netns_testbed.json

A shape is ``MxH`` = M ranks per host x H hosts (DDL_TOPOLOGY's order: fastest level first).
One file (~700 lines) because the testbed, its rank worker and the tables are used together
(``tests/integration/test_netns.py`` loads it by path: ``benchmarks`` is not a package).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import itertools
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "ddltb"
SUBNET = "10.213"  # private, 10.213.<rail>.x; only ever set inside our own namespaces
IFNAME = "eth"  # the host end of rail i's veth is eth<i>, inside its host namespace
NO_DELAY_NOTE = (
    "link delay is NOT emulated (netem is not available in this kernel); "
    "links are rate-shaped with tbf only"
)
_UNITS = {
    "bit": 1,
    "kbit": 1e3,
    "mbit": 1e6,
    "gbit": 1e9,
    "tbit": 1e12,
    "bps": 8,
    "kbps": 8e3,
    "mbps": 8e6,
    "gbps": 8e9,
    "tbps": 8e12,
}  # tc's units: decimal; bps = bytes per second
_SEQ = itertools.count()
GRACE_S = 5.0  # after one rank fails, how long the others get to report theirs
PLACEMENTS = ("block", "cyclic")
# The simulator's links for the testbed (BENCHMARKS.md, "Simulator vs testbed"): shm among ranks
# sharing 2 cores, 3 GB/s and 20 us; TCP through tbf carries ~0.956 of the shaped rate as payload
# (1x2 at 1 Gbit/s: 562 ms for 64 MB) with ~60 us per message; reductions 3 GB/s.
SIM_HOST_LINK = (3e9, 20e-6)
# With --transport tcp the host level is TCP over loopback, which costs CPU (a copy into and out
# of the kernel) on the cores every rank of the testbed shares: 2.2 GB/s over all P ranks
# together, so each rank's host link gets 1/P of it, ~40 us one way (fitted to the 1-adapter
# 2x2 and 4x2 --transport tcp rows on a quiet machine; one stream alone moves 1.64 GB/s,
# BENCHMARKS.md). Busy with other work, the machine gives less: the simulator is then optimistic.
SIM_HOST_TCP_LINK = (2.2e9, 40e-6)
SIM_NET_EFFICIENCY, SIM_NET_LAT = 0.956, 60e-6
SIM_REDUCE_BW = 3e9
# The simulator runs each host on CPUs of its own; the testbed's hosts share this machine's. With
# --transport tcp every byte a rank sends, to its host or across the shaped links, goes through
# the kernel's TCP on those cores (SIM_HOST_TCP_LINK's 2.2 GB/s, for all ranks together), and
# every reduction too (SIM_REDUCE_BW a core): a run takes at least that work over the machine.


class Expired(BaseException):
    """The whole run's --timeout passed (a BaseException, so no ``except Exception`` eats it)."""


class JobFailed(RuntimeError):
    """A rank failed or the job ran out of time; the message holds every rank's output."""


def parse_rate(text: str) -> float:
    """tc's rate syntax ("1gbit", "500mbit", "125mbps") -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]*)\s*", text.lower())
    if not m or (m.group(2) or "bit") not in _UNITS:
        raise ValueError(f"expected a tc rate like 1gbit or 500mbit, got {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2) or "bit"] / 8


def host_of(rank: int, ranks_per_host: int, hosts: int, placement: str = "block") -> int:
    """The host of ``rank``: block, r // M (host by host); cyclic, r % H (round-robin)."""
    if placement == "block":
        return rank // ranks_per_host
    if placement == "cyclic":
        return rank % hosts
    raise ValueError(f"placement {placement!r}: expected one of {', '.join(PLACEMENTS)}")


def _placement(text: str) -> str:
    if text not in PLACEMENTS:
        raise ValueError(f"placement {text!r}: expected one of {', '.join(PLACEMENTS)}")
    return text


def _assignment(text: str) -> tuple[str, str]:
    name, eq, value = text.partition("=")
    if not eq or not name:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    return name, value


def parse_shape(text: str) -> tuple[int, int]:
    """``MxH`` -> (ranks per host, hosts)."""
    try:
        m, h = (int(p) for p in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"expected a shape like 2x3 (ranks/host x hosts), got {text!r}") from None
    if m < 1 or not 1 <= h <= 250:
        raise ValueError(f"shape {text!r}: need >= 1 rank per host and 1..250 hosts")
    return m, h


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and res.returncode:
        raise RuntimeError(f"{' '.join(argv)}: exit {res.returncode}: {res.stderr.strip()}")
    return res


@dataclass
class Rank:
    rank: int
    host: int
    proc: subprocess.Popen
    out: str
    err: str

    def output(self, tail: int = 4000) -> str:
        """The end of this rank's stdout, then of its stderr."""
        return "".join(
            pathlib.Path(p).read_text(errors="replace")[-tail:] for p in (self.out, self.err)
        )


@dataclass
class Testbed:
    """N host namespaces on a bridge in a switch namespace, links shaped to ``rate`` (None: not).

    Use as a context manager; `down` is safe to call at any point of `up` and more than once.
    """

    hosts: int
    rate: str | None = None
    adapters: int = 1  # network adapters (veth pairs, rails) per host
    tag: str = field(default_factory=lambda: f"{PREFIX}-{os.getpid()}-{next(_SEQ)}")
    workdir: str | None = None  # rank logs go here; None: a temporary folder
    created: list[str] = field(default_factory=list)
    ranks: list[Rank] = field(default_factory=list)
    keep_logs: bool = False  # set when a job fails, so its logs outlive `down`
    _own_workdir: bool = field(default=False, repr=False)

    @property
    def switch(self) -> str:
        return f"{self.tag}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    @staticmethod
    def address(host: int, rail: int = 0) -> str:
        return f"{SUBNET}.{rail}.{host + 1}"

    @property
    def ifnames(self) -> list[str]:
        """The host ends of each host's rails: eth0, eth1, ..."""
        return [f"{IFNAME}{i}" for i in range(self.adapters)]

    def up(self) -> Testbed:
        if not 1 <= self.adapters <= 16:
            raise ValueError(f"adapters={self.adapters}: expected 1 to 16 per host")
        try:
            if self.workdir is None:
                self.workdir, self._own_workdir = tempfile.mkdtemp(prefix=f"{self.tag}-"), True
            self._add_ns(self.switch)
            for rail in range(self.adapters):  # one bridge (switch) and subnet per rail
                _run("ip", "-n", self.switch, "link", "add", f"br{rail}", "type", "bridge")
                _run("ip", "-n", self.switch, "link", "set", f"br{rail}", "up")
            for h in range(self.hosts):
                ns = self.namespace(h)
                self._add_ns(ns)
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                for rail, dev in enumerate(self.ifnames):
                    port = f"h{h}" if rail == 0 else f"h{h}r{rail}"
                    # Made inside the switch namespace with the peer put straight into the
                    # host's, so no link of ours ever appears in the root namespace.
                    _run(
                        "ip",
                        "-n",
                        self.switch,
                        "link",
                        "add",
                        port,
                        "type",
                        "veth",
                        "peer",
                        "name",
                        dev,
                        "netns",
                        ns,
                    )
                    _run("ip", "-n", self.switch, "link", "set", port, "master", f"br{rail}", "up")
                    _run("ip", "-n", ns, "addr", "add", f"{self.address(h, rail)}/24", "dev", dev)
                    _run("ip", "-n", ns, "link", "set", dev, "up")
                    if self.rate:
                        self._shape(ns, dev)  # host -> switch (the host's egress)
                        self._shape(self.switch, port)  # switch -> host (the host's ingress)
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _run("ip", "netns", "add", ns)
        self.created.append(ns)

    def _shape(self, ns: str, dev: str) -> None:
        assert self.rate
        # tbf needs burst >= the largest packet, and veth hands it 64 KiB GSO packets; ~1 ms of
        # line rate above that keeps the shaper's timer from being the limit at 10gbit.
        burst = max(128 << 10, int(parse_rate(self.rate) / 1000))
        _run(
            "tc",
            "-n",
            ns,
            "qdisc",
            "add",
            "dev",
            dev,
            "root",
            "tbf",
            "rate",
            self.rate,
            "burst",
            str(burst),
            "latency",
            "50ms",
        )

    def launch(
        self,
        ranks_per_host: int,
        argv: Sequence[str],
        logdir: str,
        env: Mapping[str, str] | None = None,
        ddl_timeout: float = 60.0,
        placement: str = "block",
    ) -> list[Rank]:
        """Start ``python argv...`` as rank r in the namespace of host `host_of` (r)."""
        size = ranks_per_host * self.hosts
        port = 20000 + os.getpid() % 20000  # namespaces are fresh, so any port is free there
        base = {k: v for k, v in os.environ.items() if not k.startswith("DDL_")}
        ranks = []
        for r in range(size):
            host = host_of(r, ranks_per_host, self.hosts, placement)
            local = sum(
                1 for q in range(r) if host_of(q, ranks_per_host, self.hosts, placement) == host
            )
            child = dict(
                base,
                DDL_RANK=str(r),
                DDL_SIZE=str(size),
                DDL_LOCAL_RANK=str(local),
                DDL_LOCAL_SIZE=str(ranks_per_host),
                DDL_MASTER_ADDR=self.address(0),
                DDL_MASTER_PORT=str(port),
                DDL_SOCKET_IFNAME=",".join(self.ifnames),
                DDL_TIMEOUT=str(ddl_timeout),
                **(env or {}),
            )
            out, err = (os.path.join(logdir, f"rank{r}.{s}") for s in ("out", "err"))
            with open(out, "w") as fo, open(err, "w") as fe:
                proc = subprocess.Popen(
                    ["ip", "netns", "exec", self.namespace(host), sys.executable, *argv],
                    cwd=ROOT,
                    env=child,
                    stdout=fo,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )  # own group: killed as one
            ranks.append(Rank(r, host, proc, out, err))
            self.ranks.append(ranks[-1])
        return ranks

    def run_job(
        self,
        ranks_per_host: int,
        argv: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
        ddl_timeout: float = 60.0,
        placement: str = "block",
    ) -> list[Rank]:
        """Launch, wait (killing everyone when one fails or time is up); JobFailed with logs."""
        assert self.workdir, "call up() first"
        logdir = tempfile.mkdtemp(prefix="job-", dir=self.workdir)
        ranks = self.launch(ranks_per_host, argv, logdir, env, ddl_timeout, placement)
        deadline, failed_at = time.monotonic() + timeout, None
        while None in (codes := [r.proc.poll() for r in ranks]):
            now = time.monotonic()
            if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
                break
            if failed_at is None and any(codes):
                failed_at = now
            time.sleep(0.05)
        failed = [r.rank for r in ranks if r.proc.poll() not in (None, 0)]
        stuck = [r.rank for r in ranks if r.proc.poll() is None]
        kill(ranks)
        if failed or stuck:
            self.keep_logs = True
            why = "; ".join(
                [f"ranks {failed} failed"] * bool(failed)
                + [f"ranks {stuck} still running after the job's {timeout:.0f} s"] * bool(stuck)
            )
            story = "\n".join(
                f"--- rank {r.rank} (host {r.host}, exit {r.proc.returncode}) ---\n{r.output()}"
                for r in ranks
            )
            raise JobFailed(f"{why}; logs in {logdir}\n{story}")
        return ranks

    def down(self) -> None:
        """Kill our ranks and anything left in our namespaces, remove their shm, delete the ns."""
        blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGALRM}
        old = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)  # a 2nd Ctrl-C must not stop us
        try:
            kill(self.ranks)
            for ns in self.created:
                pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
                for pid in pids:  # in our private namespace, so started by us
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                from ddlcore.transports.shm import remove_segments_of

                remove_segments_of({r.proc.pid for r in self.ranks})
            except ImportError:
                pass
            # Hosts first: deleting a host namespace deletes its veth and so the peer on the
            # bridge; the switch namespace goes last and takes the bridge with it.
            for ns in reversed(self.created):
                _run("ip", "netns", "del", ns, check=False)
            self.created = [ns for ns in self.created if ns in namespaces()]
            if self._own_workdir and self.workdir and not self.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)

    def leftovers(self) -> list[str]:
        """What of this testbed still exists (empty after `down`): namespaces, links, shm."""
        left = [f"netns {ns}" for ns in namespaces() if ns.startswith(self.tag + "-")]
        links = _run("ip", "-o", "link", check=False).stdout
        left += [f"link {line.split()[1]}" for line in links.splitlines() if self.tag in line]
        pids = {str(r.proc.pid) for r in self.ranks}
        left += [
            f"/dev/shm/{n}"
            for n in os.listdir("/dev/shm")
            if n.startswith("ddl-") and n.split("-")[1] in pids
        ]
        left += [f"pid {r.proc.pid}" for r in self.ranks if r.proc.poll() is None]
        return left

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def kill(ranks: Sequence[Rank]) -> None:
    """SIGTERM each rank's process group, SIGKILL what is left after a moment, reap all."""
    for sig, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        alive = [r for r in ranks if r.proc.poll() is None]
        for r in alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(r.proc.pid, sig)
        end = time.monotonic() + wait
        while any(r.proc.poll() is None for r in alive) and time.monotonic() < end:
            time.sleep(0.02)


def namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def reap_stale() -> list[str]:
    """Delete testbeds left by runs that were SIGKILLed (their pid, in the name, is gone)."""
    stale = [
        ns
        for ns in namespaces()
        if (m := re.match(rf"{PREFIX}-(\d+)-", ns)) and not os.path.exists(f"/proc/{m.group(1)}")
    ]
    pids = {int(pid) for ns in stale for pid in _run("ip", "netns", "pids", ns).stdout.split()}
    for pid in pids:  # our ranks, orphaned in our namespaces
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    end = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < end:
        time.sleep(0.05)
    from ddlcore.transports.shm import remove_segments_of

    remove_segments_of(pids)
    for ns in stale:
        _run("ip", "netns", "del", ns, check=False)
        for d in glob.glob(os.path.join(tempfile.gettempdir(), f"{ns.rsplit('-', 1)[0]}-*")):
            shutil.rmtree(d, ignore_errors=True)  # its rank logs
    return stale


def netns_available() -> tuple[bool, str]:
    """Whether this process can make network namespaces, and why not."""
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return False, "iproute2 (ip, tc) is not installed"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    res = _run("ip", "netns", "add", probe, check=False)
    _run("ip", "netns", "del", probe, check=False)
    return res.returncode == 0, f"ip netns add failed: {res.stderr.strip()}"


def link_bytes(nbytes: int, parts: int, collective: str = "allreduce") -> float:
    """Lower bound on the bytes each of ``parts`` members sends (and receives) over its link for
    a collective of ``nbytes`` (nccl-tests' size: the larger of input and output): 2(k-1)/k n
    for an allreduce, (k-1)/k n for a reduce-scatter or allgather. With k = hosts that is the
    bound for any algorithm; with k = ranks, what one flow of a flat ring carries (see
    `ring_flows`)."""
    from ddlcore.bench import bus_factor

    return bus_factor(collective, parts) * nbytes


def ring_flows(m: int, h: int, placement: str) -> int:
    """How many hops of the rank-order ring leave the busiest host (1 with block placement,
    M with cyclic, 0 on one host): its host link carries that many times 2(P-1)/P n."""
    p, out = m * h, [0] * h
    for r in range(p):
        a = host_of(r, m, h, placement)
        out[a] += a != host_of((r + 1) % p, m, h, placement)
    return max(out)


def box_order(m: int, h: int, placement: str) -> list[int]:
    """The box order ddlcore must find (`ddlcore.topology.build`: host by host, by rank)."""
    return sorted(range(m * h), key=lambda r: (host_of(r, m, h, placement), r))


def simulated(
    m: int,
    h: int,
    placement: str,
    rate: str | None,
    algorithm: str,
    nbytes: int,
    collective: str = "allreduce",
    adapters: int = 1,
    host_transport: str = "shm",
    segments: int = 0,
) -> float | None:
    """Seconds the simulator predicts for one ``collective`` of ``nbytes`` via ``algorithm`` with this
    rank -> host map and the testbed's links (`SIM_HOST_LINK`, or `SIM_HOST_TCP_LINK` when
    ``host_transport`` is tcp, ...), ``adapters`` per host, mdring in the job's ``segments`` (0:
    the cost model's count for these links); None where the links are not shaped
    or the algorithm is no schedule (``direct``, one host)."""
    from ddlcore import simulate, topology
    from ddlcore.algorithms import ALGORITHMS

    if not rate or h == 1 or algorithm not in ALGORITHMS[collective]:
        return None
    hosts = [f"h{host_of(r, m, h, placement)}" for r in range(m * h)]
    found = topology.build(hosts, [""] * len(hosts), {"host": host_transport, "network": "tcp"}, {})
    net = (parse_rate(rate) * SIM_NET_EFFICIENCY, SIM_NET_LAT)
    host = SIM_HOST_LINK
    if host_transport == "tcp":  # the machine's loopback TCP, shared by every rank
        host = (SIM_HOST_TCP_LINK[0] / (m * h), SIM_HOST_TCP_LINK[1])
    links = [host if level == "host" else net for level in found.levels]
    topo = topology.Topology(
        found.dims,
        found.order,
        tuple(b for b, _ in links),
        tuple(t for _, t in links),
        found.levels,
        found.note,
        adapters,
    )
    res = simulate.simulate(
        collective, algorithm, topo, nbytes, reduce_bw=SIM_REDUCE_BW, segments=segments
    )
    if host_transport != "tcp":
        return res.time_s
    return max(res.time_s, cpu_bound(res, collective))


def cpu_bound(res: Any, collective: str) -> float:
    """Seconds the machine's cores need for the TCP bytes of a simulated run (``res``, a
    `ddlcore.simulate.Result`) and its reductions (half the bytes of an allreduce, all of a
    reduce-scatter's), every rank sharing them: a run on the testbed cannot go faster."""
    sent = sum(d.bytes_per_rank for d in res.dims) * res.ranks
    reduced = sent * {"allreduce": 0.5, "reduce_scatter": 1.0}.get(collective, 0.0)
    return sent / SIM_HOST_TCP_LINK[0] + reduced / (SIM_REDUCE_BW * (os.cpu_count() or 1))


def worker(
    sizes: list[int], iters: int, warmup: int, out: str, collective: str = "allreduce"
) -> None:
    """One rank of a measurement, run inside a host namespace: ddl-bench's timing (slowest
    rank's mean after warm-ups; busbw = algbw x `bus_factor`; a size is nccl-tests': the larger
    of input and output) in O(n) memory per rank -- ddl-bench's Case keeps P float64 copies per
    rank (2.4 GB RSS at 64 MB with 8 ranks)."""
    import numpy as np

    import ddlcore
    from ddlcore.bench import bus_factor

    with ddlcore.init() as comm:
        p, rank, rows = comm.size, comm.rank, []
        for nbytes in sizes:
            count = nbytes // 4
            # Small integers: every partial sum is exact, so any reduction order gives `expect`.
            if collective == "allgather":
                k = count // p
                part = (np.arange(k) % 3 + 1).astype(np.float32)
                x = part * (rank + 1)
                expect = np.concatenate([part * (r + 1) for r in range(p)])
                run = functools.partial(comm.allgather, x)
            else:
                count -= count % p if collective == "reduce_scatter" else 0
                pattern = (np.arange(count) % 3 + 1).astype(np.float32)
                x, expect = pattern * (rank + 1), pattern * (p * (p + 1) // 2)
                if collective == "reduce_scatter":
                    k = count // p
                    expect = expect[rank * k : (rank + 1) * k]
                run = functools.partial(getattr(comm, collective), x)
            y = np.empty_like(expect)
            for _ in range(warmup):
                run(out=y)
            comm.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                run(out=y)
            t = float(comm.allreduce(np.array([(time.perf_counter() - t0) / iters]), op="max")[0])
            wrong = int(comm.allreduce(np.array([np.count_nonzero(y != expect)]))[0])
            size = max(x.nbytes, y.nbytes)
            algbw = size / t / 1e9
            choice = comm.describe(collective, x.nbytes)
            rows.append(
                dict(
                    size=size,
                    count=max(x.size, y.size),
                    time_us=t * 1e6,
                    algbw=algbw,
                    busbw=algbw * bus_factor(collective, p),
                    wrong=wrong,
                    algorithm=choice.algorithm,
                    # the schedule's pipelined segments (0: the host-staged path's own)
                    segments=0 if choice.host_path else choice.segments,
                )
            )
        if rank == 0:
            with open(out, "w") as f:
                json.dump(
                    {
                        "algorithm": rows[-1]["algorithm"],
                        "nhosts": comm.nhosts,
                        "transports": sorted(set(comm.transports.values())),
                        "box": comm.topology.shape,
                        "order": list(comm.topology.order),
                        "adapters": comm.topology.adapters,
                        "rows": rows,
                    },
                    f,
                )


def measure(
    tb: Testbed,
    m: int,
    algo: str,
    sizes: list[int],
    args: argparse.Namespace,
    deadline: float,
    placement: str = "block",
) -> dict[str, Any]:
    """One job of M x H ranks running `worker` with DDL_ALGO=algo; returns rank 0's JSON."""
    assert tb.workdir
    path = os.path.join(tempfile.mkdtemp(prefix="json-", dir=tb.workdir), "rows.json")
    argv = [
        os.path.abspath(__file__),
        "--rank-worker",
        ",".join(map(str, sizes)),
        str(args.iters),
        str(args.warmup),
        path,
        args.collective,
    ]
    tb.run_job(
        m,
        argv,
        max(1.0, deadline - time.monotonic()),
        ddl_timeout=args.ddl_timeout,
        env={"DDL_ALGO": algo, "DDL_TRANSPORT": args.transport, **dict(args.env)},
        placement=placement,
    )
    with open(path) as f:
        return json.load(f)


HEAD = (
    f"{'shape':>5s} {'A':>2s} {'place':>6s} {'rate':>7s} {'algo':>9s} {'size(B)':>10s} "
    f"{'time(us)':>10s} {'busbw':>6s} {'bound(us)':>10s} {'meas/bd':>7s} {'sim(us)':>10s} "
    f"{'sim/meas':>8s} {'link B bound':>12s} {'link B ring':>12s} {'#wrong':>6s}"
)


def table_row(r: dict[str, Any]) -> str:
    nan, algo = float("nan"), r["algo"] if r["algo"] != "auto" else f"a:{r['algorithm']}"
    sim = r.get("sim_us")
    return (
        f"{r['shape']:>5s} {r.get('adapters', 1):2d} {r.get('placement', 'block'):>6s} "
        f"{r['rate'] or '-':>7s} "
        f"{algo:>9s} {r['size']:10d} {r['time_us']:10.0f} {r['busbw']:6.3f} "
        f"{r['bound_us'] or nan:10.0f} {r['ratio_to_bound'] or nan:7.2f} "
        f"{sim or nan:10.0f} {sim / r['time_us'] if sim else nan:8.2f} "
        f"{r['link_bytes_bound']:12.0f} {r['link_bytes_flat_ring']:12.0f} {r['wrong']:6d}"
    )


def summary(results: list[dict[str, Any]]) -> list[str]:
    """Per (shape, placement, rate, size, algo, adapters) over the repeats: median time, its
    spread ((max - min) / median), ratio to the bound, speed-up over the ring of the same
    placement, over the same run with one adapter per host, and the simulator's prediction over
    the median."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        key = (
            r["shape"],
            r.get("placement", "block"),
            r["rate"],
            r["size"],
            r["algo"],
            r.get("adapters", 1),
        )
        groups.setdefault(key, []).append(r)
    median = {k: statistics.median(r["time_us"] for r in rows) for k, rows in groups.items()}
    lines = [
        f"{'shape':>5s} {'A':>2s} {'place':>6s} {'rate':>7s} {'size(B)':>10s} {'algo':>9s} "
        f"{'n':>2s} {'median us':>10s} {'spread':>6s} {'meas/bd':>7s} {'vs ring':>7s} "
        f"{'vs A=1':>6s} {'sim/meas':>8s}"
    ]
    for key, rows in groups.items():
        t, times, nan = median[key], [r["time_us"] for r in rows], float("nan")
        ring = median.get(key[:4] + ("ring", key[5]))
        one = median.get(key[:5] + (1,))
        bound, sim = rows[0]["bound_us"], rows[0].get("sim_us")
        used = "/".join(sorted({r["algorithm"] for r in rows}))
        algo = key[4] if key[4] != "auto" else f"a:{used}"
        lines.append(
            f"{key[0]:>5s} {key[5]:2d} {key[1]:>6s} {key[2] or '-':>7s} {key[3]:10d} "
            f"{algo:>9s} {len(rows):2d} {t:10.0f} {(max(times) - min(times)) / t:6.1%} "
            f"{t / bound if bound else nan:7.2f} {ring / t if ring else nan:7.2f} "
            f"{one / t if one else nan:6.2f} {sim / t if sim else nan:8.2f}"
        )
    return lines


def run_all(
    args: argparse.Namespace, algos: list[str], sizes: list[int], results: list[dict[str, Any]]
) -> int:
    """Every (shape, rate, adapters, placement, repeat, algorithm), one testbed per (shape,
    rate, adapters); rows appended to results. Repeats go round all algorithms, so a change of the machine's load
    during the run shows in every algorithm's spread alike."""
    status, deadline = 0, time.monotonic() + args.timeout
    rates = [None if r.lower() == "none" else r for r in args.rates.split(",")]
    for (m, h), rate, adapters in itertools.product(args.shapes, rates, args.adapters):
        with Testbed(h, rate, adapters) as tb:
            for placement, rep, algo in itertools.product(
                args.placement, range(args.repeat), algos
            ):
                t0, load = time.monotonic(), os.getloadavg()[0]  # others' work skews timings here
                try:
                    got = measure(tb, m, algo, sizes, args, deadline, placement)
                except JobFailed as exc:
                    print(
                        f"# {m}x{h} {placement} {rate} x{adapters} {algo}: FAILED\n{exc}",
                        file=sys.stderr,
                    )
                    status = 1
                    continue
                print(
                    f"# {m}x{h} {placement} at {rate or 'unshaped'} x {adapters} adapter(s), "
                    f"{algo} #{rep} (ran "
                    f"{got['algorithm']}, {got['nhosts']} hosts x {got['adapters']} adapters, "
                    f"box {got['box']} order "
                    f"{got['order']}, {'+'.join(got['transports'])}): "
                    f"{time.monotonic() - t0:.1f} s, load {load:.1f} before, "
                    f"{os.getloadavg()[0]:.1f} after",
                    flush=True,
                )
                if got["order"] != box_order(m, h, placement):
                    print(
                        f"# box order {got['order']}, expected {box_order(m, h, placement)}",
                        file=sys.stderr,
                    )
                    status = 1
                for row in got["rows"]:
                    c = args.collective
                    # A host's links (one per rail) carry its bytes together at best
                    bound_us = (
                        link_bytes(row["size"], h, c) / parse_rate(rate) * 1e6 / min(adapters, m)
                        if rate and h > 1
                        else None
                    )
                    sim_s = simulated(
                        m,
                        h,
                        placement,
                        rate,
                        row["algorithm"],
                        row["size"],
                        c,
                        adapters,
                        "tcp" if "shm" not in got["transports"] else "shm",
                        row.get("segments", 0),
                    )
                    results.append(
                        dict(
                            collective=c,
                            shape=f"{m}x{h}",
                            ranks_per_host=m,
                            hosts=h,
                            adapters=adapters,
                            placement=placement,
                            repeat=rep,
                            rate=rate,
                            algo=algo,
                            algorithm_used=got["algorithm"],
                            transports=got["transports"],
                            box=got["box"],
                            box_order=got["order"],
                            loadavg_before=load,
                            loadavg_after=os.getloadavg()[0],
                            bound_us=bound_us,
                            ratio_to_bound=row["time_us"] / bound_us if bound_us else None,
                            **row,
                            sim_us=sim_s * 1e6 if sim_s is not None else None,
                            link_bytes_bound=link_bytes(row["size"], h, c),
                            link_bytes_flat_ring=ring_flows(m, h, placement)
                            * link_bytes(row["size"], m * h, c),
                        )
                    )
                    status |= int(row["wrong"] > 0)
                    print(table_row(results[-1]), flush=True)
    return status


def main(argv: list[str] | None = None) -> int:
    from ddlcore.algorithms import ALGORITHMS
    from ddlcore.config import parse_size

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shapes",
        "--shape",
        default=[(2, 2)],
        type=lambda s: [parse_shape(x) for x in s.split(",")],
        help="comma list of MxH = M ranks per host x H hosts (default 2x2)",
    )
    p.add_argument("--rates", "--rate", default="1gbit", help="comma list of tc rates, or none")
    p.add_argument(
        "--sizes",
        default="1M,4M,16M,64M",
        help="comma list of byte counts",
        type=lambda s: [parse_size(x) for x in s.split(",")],
    )
    p.add_argument(
        "--algos",
        default="ring,mdring,rhd",
        help="comma list; names not registered in ddlcore are skipped with a note",
    )
    p.add_argument(
        "--placement",
        "--placements",
        default=["block"],
        type=lambda s: [_placement(x) for x in s.split(",")],
        help="comma list: block (rank r on host r // M, the default) or cyclic "
        "(rank r on host r %% H)",
    )
    p.add_argument(
        "--adapters",
        default=[1],
        type=lambda s: [int(x) for x in s.split(",")],
        help="comma list: network adapters (veth pairs, rails) per host (default 1); "
        "each is its own shaped link, bridge and subnet",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="measure each (shape, placement, algorithm) this many times",
    )
    p.add_argument(
        "-C",
        "--collective",
        default="allreduce",
        choices=("allreduce", "reduce_scatter", "allgather"),
        help="what to measure (default allreduce); sizes are nccl-tests': the larger "
        "of input and output",
    )
    p.add_argument("-n", "--iters", type=int, default=5)
    p.add_argument("-w", "--warmup", type=int, default=1)
    p.add_argument(
        "--transport",
        default="auto:tcp",
        help="DDL_TRANSPORT of the ranks (default auto:tcp: shm in a host, tcp across; "
        "plain auto would take ucx across hosts when it is installed)",
    )
    p.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        type=_assignment,
        help="another variable for the ranks, e.g. DDL_SEGMENTS=1 (repeatable)",
    )
    p.add_argument("--ddl-timeout", type=float, default=60.0, help="DDL_TIMEOUT of the ranks")
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds for the whole run; on expiry kill everything and tear down",
    )
    p.add_argument("--json", help="write every row (and the command) to this file")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    if any(not 1 <= a <= 16 for a in args.adapters):
        p.error("--adapters: each must be 1 to 16")
    for r in args.rates.split(","):
        if r.lower() != "none":
            parse_rate(r)
    known = ALGORITHMS[args.collective]
    algos = [a for a in args.algos.split(",") if a == "auto" or a in known]
    for a in sorted(set(args.algos.split(",")) - set(algos)):
        print(f"# skipping --algos {a}: not a registered {args.collective} ({', '.join(known)})")
    ok, why = netns_available()
    if not ok:
        p.error(why)
    for ns in reap_stale():
        print(f"# removed namespace {ns}, left behind by a killed run")

    def stop(signum: int, _frame: Any) -> None:
        if signum == signal.SIGALRM:
            raise Expired(f"--timeout {args.timeout:.0f} s passed")
        print(f"# netns_testbed: signal {signum}; tearing down", file=sys.stderr)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGALRM):
        signal.signal(sig, stop)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    signal.setitimer(signal.ITIMER_REAL, args.timeout)

    print(f"# {NO_DELAY_NOTE}; {os.cpu_count()} CPU cores shared by all hosts")
    results: list[dict[str, Any]] = []
    try:
        status = run_all(args, algos, args.sizes, results)
    except Expired as exc:
        print(f"# netns_testbed: {exc}; killed the ranks, tore the testbed down", file=sys.stderr)
        status = 124
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    factor = "2(H-1)/H" if args.collective == "allreduce" else "(H-1)/H"
    print(
        f"\n# {args.collective}, iters {args.iters}, warmup {args.warmup}; time = slowest "
        f"rank's mean; A = adapters per host; bound = {factor} n / (rate x min(A, M)); "
        f"sim = the simulator's time for the algorithm that ran, same rank -> host map and "
        f"adapters; link B = bytes per host link: the bound's, and the "
        f"rank-order ring's (flows x {factor.replace('H', 'P')} n)\n{HEAD}"
    )
    print("\n".join(table_row(r) for r in results))
    if args.repeat > 1 or len(args.placement) > 1 or len(args.adapters) > 1:
        print(
            f"\n# over {args.repeat} repeat(s): median, spread = (max - min) / median, "
            "vs ring = the ring's median / this median (same placement), vs A=1 = the "
            "median with one adapter per host / this median"
        )
        print("\n".join(summary(results)))
    if args.json:
        meta = {
            "command": " ".join(
                ["python", "benchmarks/netns_testbed.py", *(sys.argv[1:] if argv is None else argv)]
            ),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "note": NO_DELAY_NOTE,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return status


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank-worker"]:
        sizes, iters, warmup, out = sys.argv[2:6]
        worker([int(s) for s in sizes.split(",")], int(iters), int(warmup), out, *sys.argv[6:7])
        sys.exit(0)
    sys.exit(main())
