"""The link model and the actors that run programs on it: a discrete-event simulation of every
rank's (or stream's) program against per-rank and per-adapter FIFO ports, as the package
docstring describes. `simulate` ties it together: the choice `ddlcore.planning.tuning` makes, the
compiled program, its simulated time and the cost model's prediction beside it."""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import asdict, dataclass

from ddlcore import topology
from ddlcore.algorithms import Kind
from ddlcore.collectives import Collective
from ddlcore.planning import tuning
from ddlcore.simulate.program import (
    _AFTER,
    _DONE,
    DEFAULT_CHUNK_BYTES,
    MAX_STEPS,
    Program,
    SimulationError,
    compile_program,
)

_SEND, _RECV_REDUCE = int(Kind.SEND), int(Kind.RECV_REDUCE)
_COPY = int(Kind.COPY)


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
        nseg = tuning.best_mdring(
            collective, topo, nbytes, dim_order, reduce_bw, False, chunk_bytes=chunk_bytes
        )[1]
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
