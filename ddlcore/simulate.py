"""The simulator: runs the SAME schedules the engine runs against a link model, to predict a
collective's time at scales this machine cannot run (e.g. 64 hosts x 4 GPUs in 4 racks).

What it models (the link model of `ddlcore.tuning`, so the two can be compared):

* A message from rank a to rank b crosses box dimension j = ``topo.dim_between(a, b)``. It holds
  its ports for ``nbytes / bw[j]`` and then is in flight for ``lat[j]`` (latency occupies
  nothing): it arrives at ``start + nbytes / bw[j] + lat[j]``.
* Inside a host (j < ``topo.host_dims``) the ports are per rank and dimension: a's egress and b's
  ingress (point-to-point links, like NVLink). Across the network a message holds the egress
  port of a's network adapter and the ingress port of b's (``topo.adapter_of``): the ranks of a
  host share their adapters, which is the contention of concurrent rings.
* Ports are FIFO servers: messages reserve all their ports in the order they are issued (ties
  by rank) and start when every port is free; no backfilling, no fair sharing (a message that
  waits for its ingress port keeps its egress port idle and later messages behind it).
* Each rank executes its schedule in program order, as `ddlcore.engine` does: ``SEND`` issues at
  the rank's current time and the rank goes on; ``RECV`` waits for the message's arrival;
  ``RECV_REDUCE`` waits, then keeps the rank busy ``nbytes / reduce_bw``; ``COPY`` keeps it busy
  ``nbytes / copy_bw``. A rank's reductions and copies are serial; its messages overlap them.
  A schedule with parts on several streams (mdring pipelined across dimensions) runs each
  stream as an actor of its own, as the engine runs each on a thread: a part starts once the
  parts it comes after have finished (their steps done, their sends out of the ports); each
  stream's reductions are serial, different streams' overlap.

What it does not model: packets, congestion control, switch or rack-uplink oversubscription
(a level is only a bandwidth and a latency per message), the engine's pipeline depth and staging
slots (every message is buffered at its receiver on arrival), write-after-send hazards, and
per-message software overhead beyond ``lat``.

It is a discrete-event simulation: a heap of actors (ranks, or streams of ranks) by their clock;
the earliest runs on while its clock stays the earliest, so messages claim ports in global
issue order. Schedules are
compiled to flat arrays first (`Program`), so the event loop creates no per-step objects.
Generating the schedules costs the algorithm modules ~10 us per step (the event loop ~3 us).
The flat ring and rhd at 4096 ranks have ~67M steps (12 and 19 min of CPU, 1.7 and 4 GB);
runs estimated above ``max_steps`` are refused with `TooLargeToSimulate` (the CLI prints NOT
SIMULATED and why, exit status 3; ``--max-steps 1e8`` runs them), never replaced by a formula.

One file (~550 lines) because the model, its event loop and its CLI are read together.

    python -m ddlcore.simulate --topology 4x16x4 --link-bw 20e9,10e9,9.5e9 \\
        --link-lat 5e-6,10e-6,20e-6 --bytes 100e6 --algo mdring [--adapters 4] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import itertools
import json
import math
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ddlcore import topology, tuning
from ddlcore.algorithms import ALGORITHMS, Kind, Schedule, Step
from ddlcore.collectives import Collective
from ddlcore.errors import DDLError

_SEND, _RECV_REDUCE = int(Kind.SEND), int(Kind.RECV_REDUCE)
_COPY = int(Kind.COPY)
_AFTER, _DONE = -1, -2  # a part's markers in an actor's program (`Program`)
# Default step budget: 16M steps take 3-5 minutes of CPU to generate and simulate on this
# project's VM (11-18 us/step in all: 67M steps took 713 s for the ring, 1160 s for rhd);
# mdring at 4096 ranks is ~6.5M.
MAX_STEPS = 16_000_000
DEFAULT_CHUNK_BYTES = 1 << 20  # DDL_CHUNK_BYTES's default
# The CLI's default links, the PowerAI DDL paper's cluster (Cho et al. 2017): NVLink inside a host,
# then in-rack and cross-rack network (bytes/s, and per-message latency in seconds).
PAPER_BW = [20e9, 10e9, 9.5e9]
PAPER_LAT = [5e-6, 10e-6, 20e-6]


class SimulationError(DDLError):
    """The schedules cannot run: a deadlock, an unmatched message, or mismatched sizes."""


class TooLargeToSimulate(SimulationError):
    """The run would exceed the step budget; it was not simulated."""


@dataclass(frozen=True)
class Program:
    """All ranks' schedules as flat arrays, one program per stream of each rank (an "actor";
    a schedule without parts is one): kind, peer, message key, bytes.

    A message's key is ``(sender * size + receiver) << 32 | slot``, the same on both ends. The
    parts of a schedule with streams become markers in its actors' programs: ``_AFTER`` (wait
    until part ``key`` has finished) before a part's steps, ``_DONE`` (part ``key`` finished
    once its sends have left) after them; part keys are numbered across the whole program."""

    collective: str
    algorithm: str
    size: int
    owner: tuple[int, ...]  # the rank of each actor
    kinds: tuple[array, ...]
    peers: tuple[array, ...]
    keys: tuple[array, ...]
    nbytes: tuple[array, ...]
    dim_order: tuple[int, ...] | None = None
    steps: int = 0  # the schedules' steps, all ranks (markers not counted)
    segments: int = 1

    @classmethod
    def from_schedules(
        cls,
        schedules: Iterable[Schedule],
        size: int,
        itemsize: int,
        dim_order: tuple[int, ...] | None = None,
        segments: int = 1,
    ) -> Program:
        """Compile ``size`` ranks' schedules (rank order), one at a time: an iterator of
        schedules never holds every rank's steps as objects."""
        owner: list[int] = []
        kinds, peers, keys, nbytes = [], [], [], []
        name = ("", "")
        total = part_base = 0
        ranks = 0
        for rank, sched in enumerate(schedules):
            ranks += 1
            name = (sched.collective, sched.algorithm)
            steps = sched.steps
            total += len(steps)
            bad = [
                s
                for s in steps
                if s.kind != Kind.COPY
                and not (0 <= s.peer < size and s.peer != rank and 0 <= s.slot < 1 << 32)
            ]
            if bad:
                raise SimulationError(f"rank {rank}: bad peer or slot in step {bad[0].describe()}")

            def key(s: Step, rank: int = rank) -> int:
                if s.kind == Kind.COPY:
                    return 0
                pair = rank * size + s.peer if s.kind == Kind.SEND else s.peer * size + rank
                return pair << 32 | s.slot

            if not sched.parts:
                programs = [[(int(s.kind), s.peer, key(s), s.count * itemsize) for s in steps]]
            else:
                groups = sched.part_steps
                programs = []
                for parts in sched.streams().values():
                    prog = []
                    for p in parts:
                        prog += [(_AFTER, -1, part_base + q, 0) for q in sched.parts[p].after]
                        prog += [
                            (int(s.kind), s.peer, key(s), s.count * itemsize) for s in groups[p][1]
                        ]
                        prog.append((_DONE, -1, part_base + p, 0))
                    programs.append(prog)
                part_base += len(sched.parts)
            for prog in programs:
                owner.append(rank)
                kinds.append(array("b", [x[0] for x in prog]))
                peers.append(array("l", [x[1] for x in prog]))
                keys.append(array("q", [x[2] for x in prog]))
                nbytes.append(array("q", [x[3] for x in prog]))
        if ranks != size:
            raise ValueError(f"{ranks} schedules for {size} ranks")
        return cls(
            name[0],
            name[1],
            size,
            tuple(owner),
            tuple(kinds),
            tuple(peers),
            tuple(keys),
            tuple(nbytes),
            dim_order,
            total,
            segments,
        )


def element_count(collective: str, nbytes: float, size: int, itemsize: int) -> int:
    """The schedule's ``count`` for ``nbytes`` as `tuning.predict` reads it: the allreduce and
    reduce_scatter input (reduce_scatter: a multiple of ``size``), the allgather output."""
    count = int(nbytes) // itemsize
    if collective == Collective.REDUCE_SCATTER:
        return count // size * size
    if collective == Collective.ALLGATHER:
        return count // size
    return count


def compile_program(
    collective: str,
    algorithm: str,
    topo: topology.Topology,
    nbytes: float,
    itemsize: int = 4,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    dim_order: tuple[int, ...] | None = None,
    max_steps: int = MAX_STEPS,
    segments: int = 1,
) -> Program:
    """Generate every rank's schedule with the library's own algorithm functions (mdring's
    allreduce pipelined in ``segments``).

    Raises `TooLargeToSimulate` (before generating them all) when the first and last ranks'
    schedules say the total would exceed ``max_steps``."""
    make = ALGORITHMS[collective][algorithm]
    size = topo.size
    count = element_count(collective, nbytes, size, itemsize)
    extra: dict = {}
    if algorithm == "mdring" and dim_order is not None:
        extra["dim_order"] = dim_order
    if algorithm == "mdring" and collective == Collective.ALLREDUCE and segments > 1:
        extra["segments"] = segments

    def schedule(rank: int) -> Schedule:
        return make(rank, size, count, itemsize, chunk_bytes, topo, **extra)

    ends = [schedule(0), schedule(size - 1)]
    estimate = max(len(s.steps) for s in ends) * size
    if estimate > max_steps:
        raise TooLargeToSimulate(
            f"{collective} via {algorithm} on {size} ranks has ~{estimate / 1e6:.1f}M steps "
            f"({max(len(s.steps) for s in ends)} per rank), over the budget of "
            f"{max_steps / 1e6:.1f}M (max_steps / --max-steps); it would take "
            f"{estimate * 11e-6 / 60:.0f}-{estimate * 18e-6 / 60:.0f} min of CPU and "
            f"{estimate * 25 / 1e9:.1f}-{estimate * 60 / 1e9:.1f} GB here"
        )
    scheds = itertools.chain(ends[:1], (schedule(r) for r in range(1, size - 1)), ends[1:size])
    return Program.from_schedules(scheds, size, itemsize, dim_order, segments)


@dataclass(frozen=True)
class DimStats:
    dim: int
    size: int
    level: str
    bw: float
    lat: float
    bytes_per_rank: int  # most bytes one rank sent along this dimension
    messages: int  # messages along this dimension, all ranks
    busy_s: float  # longest time one port was busy with this dimension's messages


@dataclass(frozen=True)
class Result:
    collective: str
    algorithm: str
    dim_order: tuple[int, ...] | None
    topology: str
    adapters: int
    ranks: int
    nbytes: float
    time_s: float
    predicted_s: float
    steps: int
    dims: tuple[DimStats, ...]
    segments: int = 1

    @property
    def algbw(self) -> float:
        return self.nbytes / self.time_s if self.time_s > 0 else math.inf

    @property
    def busbw(self) -> float:
        n = self.ranks
        factor: dict[str, float] = {Collective.ALLREDUCE: 2 * (n - 1) / n, Collective.BROADCAST: 1}
        return self.algbw * factor.get(self.collective, (n - 1) / n)

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(simulated=True, algbw=self.algbw, busbw=self.busbw)
        return out


def execute(
    program: Program,
    topo: topology.Topology,
    reduce_bw: float = tuning.REDUCE_BW,
    copy_bw: float | None = None,
) -> tuple[float, list[float], tuple[DimStats, ...]]:
    """Run ``program`` on ``topo``'s links: (time, finish time per rank, per-dimension stats).

    Raises `SimulationError` on a deadlock, an unmatched message or mismatched message sizes."""
    size, k, host_dims = program.size, len(topo.dims), topo.host_dims
    if size != topo.size:
        raise ValueError(f"program has {size} ranks, topology {topo.shape} has {topo.size}")
    inv_reduce, inv_copy = 1.0 / reduce_bw, 1.0 / (copy_bw or reduce_bw)
    inv_bw, lat = [1.0 / b for b in topo.bw], list(topo.lat)
    net_base = 2 * size * k  # ports: per-rank egress/ingress per host dim, then adapters
    nports = net_base + 2 * (size // topo.ranks_per_node + 1) * topo.adapters
    free = [0.0] * nports
    busy = [0.0] * (nports * k)
    sent = [0] * (size * k)
    messages = [0] * k
    links: dict[int, tuple[int, int, int]] = {}  # sender*size + receiver: (dim, egress, ingress)

    def link(a: int, b: int) -> tuple[int, int, int]:
        j = topo.dim_between(a, b)
        if j < host_dims:
            return j, a * k + j, (size + b) * k + j
        (ha, aa), (hb, ab) = topo.adapter_of(a), topo.adapter_of(b)
        egress = net_base + 2 * (ha * topo.adapters + aa)
        return j, egress, net_base + 2 * (hb * topo.adapters + ab) + 1

    arrived: dict[int, tuple[float, int]] = {}  # key -> (arrival time, bytes)
    waiting: dict[int, int] = {}  # key -> the actor blocked on it
    finished: dict[int, float] = {}  # part -> when it finished
    after: dict[int, list[int]] = {}  # part -> the actors waiting for it
    owner = program.owner
    nactors = len(owner)
    pcs, clock, sends_end = [0] * nactors, [0.0] * nactors, [0.0] * nactors
    finish = [0.0] * size
    heap = [(0.0, a) for a in range(nactors)]
    push, pop, inf = heapq.heappush, heapq.heappop, math.inf
    while heap:
        t, a = pop(heap)
        r = owner[a]
        kinds, peers, keys, nbytes = (
            program.kinds[a],
            program.peers[a],
            program.keys[a],
            program.nbytes[a],
        )
        n, pc = len(kinds), pcs[a]
        limit = heap[0][0] if heap else inf
        while pc < n:
            kind, key, nb = kinds[pc], keys[pc], nbytes[pc]
            if kind == _SEND:
                pair = key >> 32
                info = links.get(pair)
                if info is None:
                    info = links[pair] = link(r, peers[pc])
                j, ep, ip = info
                start = t if t > free[ep] else free[ep]
                if free[ip] > start:
                    start = free[ip]
                dur = nb * inv_bw[j]
                end = free[ep] = free[ip] = start + dur
                if end > sends_end[a]:
                    sends_end[a] = end
                busy[ep * k + j] += dur
                busy[ip * k + j] += dur
                sent[r * k + j] += nb
                messages[j] += 1
                if key in arrived:
                    raise SimulationError(
                        f"rank {r} sends slot {key & 0xFFFFFFFF} to rank "
                        f"{peers[pc]} twice (step {pc})"
                    )
                arrival = end + lat[j]
                arrived[key] = (arrival, nb)
                w = waiting.pop(key, None)
                if w is not None:
                    wake = arrival if arrival > clock[w] else clock[w]
                    push(heap, (wake, w))
                    if wake < limit:
                        limit = wake
            elif kind == _COPY:
                t += nb * inv_copy
            elif kind == _DONE:  # the part ends once its sends have left (the engine waits)
                done = finished[key] = t if t > sends_end[a] else sends_end[a]
                for w in after.pop(key, ()):
                    wake = done if done > clock[w] else clock[w]
                    push(heap, (wake, w))
                    if wake < limit:
                        limit = wake
            elif kind == _AFTER:
                if key not in finished:
                    after.setdefault(key, []).append(a)
                    break
                done = finished[key]
                if done > t:
                    if done > limit:
                        t = done
                        push(heap, (t, a))
                        pc += 1
                        break
                    t = done
            else:
                msg = arrived.get(key)
                if msg is None:
                    waiting[key] = a
                    break
                if msg[0] > t:
                    if msg[0] > limit:
                        t = msg[0]
                        push(heap, (t, a))
                        break
                    t = msg[0]
                del arrived[key]
                if msg[1] != nb:
                    raise SimulationError(
                        f"rank {r} step {pc} expects {nb} bytes from rank "
                        f"{peers[pc]} (slot {key & 0xFFFFFFFF}), it sent "
                        f"{msg[1]}"
                    )
                if kind == _RECV_REDUCE:
                    t += nb * inv_reduce
            pc += 1
            if t > limit:
                push(heap, (t, a))
                break
        pcs[a], clock[a] = pc, t
        if pc == n and t > finish[r]:
            finish[r] = t
    _check_complete(program, pcs, waiting, arrived)
    dims = tuple(
        DimStats(
            j,
            topo.dims[j],
            topo.levels[j],
            topo.bw[j],
            topo.lat[j],
            max(sent[r * k + j] for r in range(size)),
            messages[j],
            max(busy[p * k + j] for p in range(nports)),
        )
        for j in range(k)
    )
    return max(finish, default=0.0), finish, dims


def _check_complete(
    program: Program, pcs: list[int], waiting: dict[int, int], arrived: dict[int, tuple[float, int]]
) -> None:
    stuck = [a for a in range(len(program.owner)) if pcs[a] < len(program.kinds[a])]
    if stuck:

        def blocked(a: int) -> str:
            r, pc = program.owner[a], pcs[a]
            if program.kinds[a][pc] == _AFTER:
                return f"rank {r} at step {pc} waits for its part {program.keys[a][pc]}"
            return (
                f"rank {r} at step {pc} waits for rank {program.peers[a][pc]} "
                f"(slot {program.keys[a][pc] & 0xFFFFFFFF})"
            )

        ranks = sorted({program.owner[a] for a in stuck})
        raise SimulationError(
            f"deadlock: {len(ranks)} of {program.size} ranks never finish; "
            + "; ".join(blocked(a) for a in stuck[:4])
            + ("; ..." if len(stuck) > 4 else "")
        )
    if arrived:
        lost = [
            f"rank {(key >> 32) // program.size} -> rank {(key >> 32) % program.size} "
            f"slot {key & 0xFFFFFFFF}"
            for key in list(arrived)[:4]
        ]
        raise SimulationError(f"{len(arrived)} messages were never received: " + "; ".join(lost))


def simulate(
    collective: str,
    algorithm: str,
    topo: topology.Topology,
    nbytes: float,
    itemsize: int = 4,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    dim_order: tuple[int, ...] | None = None,
    reduce_bw: float = tuning.REDUCE_BW,
    copy_bw: float | None = None,
    max_steps: int = MAX_STEPS,
    program: Program | None = None,
    segments: int = 0,
) -> Result:
    """Simulate ``collective`` of ``nbytes`` with ``algorithm`` (or ``auto``) on ``topo``.

    The algorithm, mdring's dimension order and its pipelined segments come from
    `tuning.choose`, as in a real job, unless ``dim_order`` / ``segments`` (> 0) are given.
    ``program`` reuses compiled schedules (they do not depend on the link speeds or adapters).
    Raises `TooLargeToSimulate` or `SimulationError`."""
    choice = tuning.choose(collective, topo, int(nbytes), algorithm, chunk_bytes, segments=segments)
    order = dim_order if dim_order is not None else choice.dim_order
    nseg = choice.segments
    if choice.algorithm != "mdring":
        order, nseg = None, 1
    elif dim_order is not None and segments <= 0:  # the best count for the order asked
        nseg = tuning.best_mdring(collective, topo, nbytes, dim_order, reduce_bw, False)[1]
    if program is None:
        program = compile_program(
            collective,
            choice.algorithm,
            topo,
            nbytes,
            itemsize,
            chunk_bytes,
            order,
            max_steps,
            nseg,
        )
    elif (program.collective, program.algorithm) != (collective, choice.algorithm):
        raise ValueError(
            f"program is {program.collective} via {program.algorithm}, not "
            f"{collective} via {choice.algorithm}"
        )
    else:
        nseg = program.segments
    time_s, _, dims = execute(program, topo, reduce_bw, copy_bw)
    predicted = tuning.predict(
        collective, choice.algorithm, topo, nbytes, order, reduce_bw, segments=nseg
    )
    return Result(
        collective,
        choice.algorithm,
        order,
        topo.shape,
        topo.adapters,
        topo.size,
        float(nbytes),
        time_s,
        predicted,
        program.steps,
        dims,
        nseg,
    )


def cyclic(topo: topology.Topology) -> topology.Topology:
    """``topo`` with ranks dealt round-robin over its nodes (hosts): rank r on node r % N, as
    ``mpiexec --map-by node`` places them. The box is the same; only who sits where changes,
    so rank-ordered algorithms (ring) cross the network on every hop, box-ordered ones do not."""
    per_node = topo.ranks_per_node
    nodes = topo.size // per_node
    order = tuple(local * nodes + node for node in range(nodes) for local in range(per_node))
    return dataclasses.replace(topo, order=order)


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _report(res: Result) -> str:
    order = f" (dimensions in order {','.join(map(str, res.dim_order))})" if res.dim_order else ""
    if res.segments > 1:
        order += f" pipelined in {res.segments} segments"
    lines = [
        f"{res.collective} of {res.nbytes / 1e6:g} MB via {res.algorithm}{order} on {res.topology} "
        f"({res.ranks} ranks, {res.adapters} network adapter(s) per host), {res.steps} steps",
        f"simulated {res.time_s * 1e3:.3f} ms   algbw {res.algbw / 1e9:.2f} GB/s   busbw "
        f"{res.busbw / 1e9:.2f} GB/s   cost model (tuning.predict) {res.predicted_s * 1e3:.3f} ms",
        f"{'dim':>3} {'size':>5} {'level':<11} {'GB/s':>6} {'lat us':>6} {'MB sent/rank':>12} "
        f"{'messages':>9} {'busiest port ms':>15}",
    ]
    for d in res.dims:
        lines.append(
            f"{d.dim:>3} {d.size:>5} {d.level:<11} {d.bw / 1e9:>6.3g} {d.lat * 1e6:>6.3g} "
            f"{d.bytes_per_rank / 1e6:>12.3f} {d.messages:>9} {d.busy_s * 1e3:>15.3f}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """CLI. Exit status 0: simulated; 3: refused as too large (NOT SIMULATED, with the reason)."""
    p = argparse.ArgumentParser(
        prog="python -m ddlcore.simulate",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--collective",
        default="allreduce",
        choices=tuning.SELECTABLE,
        help="the collective to simulate",
    )
    p.add_argument("--topology", default="4x16x4", help="box, fastest dimension first")
    p.add_argument(
        "--link-bw",
        default="",
        help="bytes/s per dimension, comma-separated; one "
        "value applies to every dimension, fewer values than dimensions repeat the "
        "last (20e9,10e9 on a 3-D box: 20e9,10e9,10e9; the table shows each "
        "dimension's); empty: the paper's 20e9,10e9,9.5e9 for as many dimensions as "
        "the box has",
    )
    p.add_argument(
        "--link-lat",
        default="",
        help="seconds per dimension, as --link-bw (empty: 5e-6,10e-6,20e-6)",
    )
    p.add_argument("--bytes", type=float, default=100e6, help="each rank's input in bytes")
    p.add_argument("--algo", default="auto", help="ring, mdring, rhd, rd or auto")
    p.add_argument(
        "--segments",
        type=int,
        default=0,
        help="mdring allreduce: pipelined "
        "segments (0: the cost model's choice, 1: the phases one after another)",
    )
    p.add_argument(
        "--dim-order",
        default="",
        help="mdring phase order, e.g. 0,2,1 (empty: the best, under auto)",
    )
    p.add_argument("--adapters", type=int, default=1, help="network adapters per host")
    p.add_argument(
        "--placement",
        default="block",
        choices=("block", "cyclic"),
        help="rank -> host map: block (host by host, as launchers do by default) or "
        "cyclic (round-robin over hosts: rank order crosses a host every hop)",
    )
    p.add_argument(
        "--levels",
        default="",
        help="level per dimension, comma-separated (empty: "
        "the first inside a host, the others across the network, e.g. host,rack,"
        "cross-rack)",
    )
    p.add_argument(
        "--reduce-bw", type=float, default=tuning.REDUCE_BW, help="bytes/s of the reduction kernel"
    )
    p.add_argument(
        "--copy-bw", type=float, default=None, help="bytes/s of a local copy (None: --reduce-bw)"
    )
    p.add_argument("--itemsize", type=int, default=4, help="bytes per element")
    p.add_argument(
        "--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES, help="pipeline chunk in bytes"
    )
    p.add_argument(
        "--max-steps",
        type=float,
        default=MAX_STEPS,
        help="refuse (exit 3) schedules with more steps than this",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    try:
        dims = [int(d) for d in a.topology.lower().split("x")]
    except ValueError:
        p.error(f"--topology {a.topology!r}: expected sizes like 4x16x4")
    if a.algo != "auto" and a.algo not in ALGORITHMS[a.collective]:
        p.error(f"--algo {a.algo!r}: {a.collective} has {sorted(ALGORITHMS[a.collective])} or auto")
    try:
        bw = _floats(a.link_bw) if a.link_bw else PAPER_BW[: len(dims)]
        lat = _floats(a.link_lat) if a.link_lat else PAPER_LAT[: len(dims)]
        topo = topology.box(
            dims,
            topology.per_dim(bw, len(dims), "--link-bw"),
            topology.per_dim(lat, len(dims), "--link-lat"),
            a.levels.split(",") if a.levels else None,
            a.adapters,
        )
    except ValueError as exc:
        p.error(str(exc))
    if a.placement == "cyclic":
        topo = cyclic(topo)
    order = tuple(int(v) for v in a.dim_order.split(",")) if a.dim_order else None
    try:
        res = simulate(
            a.collective,
            a.algo,
            topo,
            a.bytes,
            a.itemsize,
            a.chunk_bytes,
            order,
            a.reduce_bw,
            a.copy_bw,
            int(a.max_steps),
            segments=a.segments,
        )
    except TooLargeToSimulate as exc:
        choice = tuning.choose(
            a.collective, topo, int(a.bytes), a.algo, a.chunk_bytes, segments=a.segments
        )
        model = tuning.predict(
            a.collective,
            choice.algorithm,
            topo,
            a.bytes,
            order or choice.dim_order,
            a.reduce_bw,
            segments=choice.segments,
        )
        if a.json:
            print(
                json.dumps(
                    {
                        "simulated": False,
                        "reason": str(exc),
                        "time_s": None,
                        "algorithm": choice.algorithm,
                        "topology": topo.shape,
                        "predicted_s": model,
                    }
                )
            )
        else:
            print(
                f"NOT SIMULATED: {exc}\n(the cost model alone predicts {model * 1e3:.3f} ms; "
                "that is a formula, not a simulation)"
            )
        return 3
    print(json.dumps(res.to_json()) if a.json else _report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
