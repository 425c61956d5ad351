"""Tuning: an alpha-beta-gamma cost model over the algorithms, and the choice it makes.

A collective runs as phases; in a phase every rank takes ``steps`` steps, each sending ``m``
bytes across one box dimension j (latency ``lat[j]``, bandwidth ``bw[j]``) and, in a
reduce-scatter, reducing them (``gamma`` = seconds per byte of the reduction kernel)::

    T = sum over phases of  steps * (lat[j] + m * share / bw[j] + m * gamma)

(with the reduction overlapped, max instead of +, when m streams in several pipeline chunks).

``share`` is how many ranks of one host push bytes through the host's network adapter at the
same time in that phase: 1 inside a host (point-to-point links), and the ranks per host (over
the host's adapters, `Topology.adapters`) when every rank crosses the network at once (a
multi-dimensional ring's network phases, halving-doubling's distant rounds). The flat ring runs
in rank order: with ranks placed host by host it crosses each host boundary with one flow, with
ranks dealt round-robin over the hosts every hop leaves its host and the host's ranks share its
adapter (``share`` counted per hop); every one of its 2(P - 1) steps waits for the slowest hop.
mdring on a one-dimensional box is the ring in box order (host by host). The simulator
(``ddlcore.simulate``) runs the schedules themselves against the same link model and is how this
formula is checked.

Where an allreduce's host dimensions can run through the shared boards (``paths.host_staged``,
``host_path=True``), mdring's host phases with those dimensions first are priced as the boards
run them: two native calls of two sync points each, every rank reading (d - 1)/d of its share
with ``process_vm_readv`` (and reducing it, in the first). A reduce-scatter's or allgather's
host phase runs on the boards too, but is priced as the rings over shm it replaces, as the
other algorithms' steps inside a host are: priced as the boards, mdring lost a near-tie to rhd
that it wins by 1.27x on the testbed (BENCHMARKS.md, "Reduce-scatter and allgather across
hosts"): the ring model's per-rank shm links flatter every in-host schedule alike.

mdring's allreduce may run pipelined across the dimensions (segments whose phases overlap,
`ddlcore.algorithms.mdring`); `_mdring` prices it and auto picks the segment count with the
order (``DDL_SEGMENTS`` overrides the count).

``DDL_ALGO`` names the algorithm of the reduction collectives (those without it, e.g.
reduce_scatter under ``rd``, fall back to ``auto``); ``auto`` takes the lowest predicted time (for mdring also over the order of the box dimensions). Broadcast and barrier have
one algorithm each (pipelined chain, dissemination). The chunk size is ``DDL_CHUNK_BYTES``.
``DDL_DEBUG=1`` logs each choice and ``python -m ddlcore info`` prints it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from ddlcore.algorithms import ALGORITHMS, mdring
from ddlcore.algorithms.halving_doubling import virtual_shape
from ddlcore.algorithms.mdring import active_dims
from ddlcore.collectives import Collective
from ddlcore.topology import Topology

# Collectives for which DDL_ALGO selects among several algorithms.
# As plain strings: argparse lists them in its messages (`ddlcore.simulate`).
SELECTABLE = tuple(
    c.value for c in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER)
)
# Bytes/s of the reduction kernels (float32 sum, a+=b: measured ~5-10 GB/s single-threaded on this
# project's VM, BENCHMARKS.md); only their ratio to the links matters for the choice.
REDUCE_BW = 8e9
# The pipeline chunk the ring's prediction assumes (DDL_CHUNK_BYTES's default).
CHUNK_BYTES = 1 << 20
# The host collectives (mdring's host phases on the boards): one sync point of the host's ranks,
# and the rate of process_vm_readv into cache (measured 8-11 GB/s on this project's VM, np = 2;
# BENCHMARKS.md "Host collectives").
BOARD_SYNC_S = 5e-6
BOARD_BW = 8e9
# Predictions this close count as a tie (the model is not that precise).
TIE = 0.01
# mdring dimension orders tried by auto: all of them up to this many dimensions.
MAX_PERMUTED_DIMS = 4
# mdring's pipelined segment counts tried by auto, and the smallest segment: in the simulator,
# smaller segments (more streams' messages queueing at FIFO ports) fell behind the model by up
# to 30% on 4x2 boxes, and each segment costs the engine a few Python-level waits per phase.
SEGMENT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MIN_SEGMENT_BYTES = 8 << 20
# mdring with host phases on the boards (``ddlcore.paths.host_staged``) splits an allreduce into
# segments of at least this many bytes, at most _HOST_SEGMENTS of them, pipelined on two
# threads (``ddlcore.pipeline``): on the netns testbed at 4x2, 1 Gbit/s, 64 MB went from
# 1.22-1.28x the link bound to 1.09x (BENCHMARKS.md).
_HOST_SEGMENT_BYTES = 4 << 20
_HOST_SEGMENTS = 8


@dataclass(frozen=True)
class Choice:
    algorithm: str
    chunk_bytes: int
    dim_order: tuple[int, ...] | None = None  # mdring: the order of the ring phases
    predicted_s: float = math.nan
    host_path: str = ""  # mdring: the host dimensions run as this host collective instead
    segments: int = 1  # mdring allreduce: pipelined across the dimensions in this many

    def describe(self) -> str:
        text = f"{self.algorithm}"
        if self.dim_order is not None:
            text += f" (dimensions in order {','.join(map(str, self.dim_order))})"
        if self.host_path:
            text += f", host dimensions through shared memory ({self.host_path})"
        if self.segments > 1:
            text += f", pipelined in {self.segments} segments"
        text += f", chunks of {self.chunk_bytes} B"
        if not math.isnan(self.predicted_s):
            text += f", predicted {self.predicted_s * 1e6:.1f} us"
        return text


# The host collectives' name (``ddlcore.hostcoll``): not a schedule, a whole collective through
# shared memory, taken under ``auto`` whenever every rank is on one host and talks shm.
DIRECT = "direct"


def validate_algo(algo: str) -> None:
    """ValueError naming DDL_ALGO if no reduction collective knows ``algo``."""
    if algo in ("auto", DIRECT):
        return
    known = sorted({name for coll in SELECTABLE for name in ALGORITHMS[coll]})
    if algo not in known:
        raise ValueError(
            f"DDL_ALGO={algo!r} is not an algorithm; use auto, {DIRECT} or one of {known}"
        )


# --- the model -----------------------------------------------------------------------------------


def _phase(
    topo: Topology,
    dim: int,
    steps: int,
    nbytes: float,
    share: int,
    reduce: bool,
    gamma: float,
    chunk_bytes: float = 0.0,
) -> float:
    """``steps`` steps of ``nbytes`` across ``dim``; a reduce-scatter step reduces them too,
    overlapped with the transfer when they stream in several chunks (chunk k is reduced while
    chunk k+1 is on the wire)."""
    if steps <= 0 or dim < 0:
        return 0.0
    transfer = nbytes / topo.bw[dim]
    work = nbytes * gamma if reduce else 0.0
    own = max(transfer, work) if chunk_bytes and nbytes > chunk_bytes else transfer + work
    # A shared adapter carries the other ranks' bytes while this rank waits out its latency
    # and reduces its own.
    return steps * max(topo.lat[dim] + own, transfer * share)


def _share(topo: Topology, dim: int, concurrent: int) -> int:
    """Flows through one network adapter when ``concurrent`` ranks per host cross ``dim`` at
    once (their flows are dealt over the host's adapters)."""
    return 1 if dim < topo.host_dims else max(1, -(-concurrent // topo.adapters))


def _ring_hops(topo: Topology, order: tuple[int, ...]) -> list[tuple[int, int]]:
    """(dimension crossed, flows sharing the busiest adapter on the way) of each hop of the ring
    through ``order``: network hops leaving (or entering) the same adapter share it."""
    p = len(order)
    pairs = [(order[i], order[(i + 1) % p]) for i in range(p)]
    dims = [topo.dim_between(a, b) for a, b in pairs]
    out_flows: dict[tuple[int, int], int] = {}
    in_flows: dict[tuple[int, int], int] = {}
    for (a, b), j in zip(pairs, dims, strict=True):
        if j >= topo.host_dims:
            out_flows[topo.adapter_of(a)] = out_flows.get(topo.adapter_of(a), 0) + 1
            in_flows[topo.adapter_of(b)] = in_flows.get(topo.adapter_of(b), 0) + 1
    return [
        (
            j,
            1
            if j < topo.host_dims
            else max(out_flows[topo.adapter_of(a)], in_flows[topo.adapter_of(b)]),
        )
        for (a, b), j in zip(pairs, dims, strict=True)
    ]


def _ring(
    topo: Topology,
    nbytes: float,
    rs: bool,
    ag: bool,
    gamma: float,
    chunk_bytes: float,
    order: tuple[int, ...] | None = None,
) -> float:
    """The ring through ``order`` (default rank order, the ``ring`` algorithm's)."""
    p = topo.size
    if p == 1:
        return 0.0
    # Its steps form one dependency chain around the ring (rank r's step g waits for rank
    # r-1's step g-1), so it pays the MEAN hop's latency per step; when segments stream in
    # several chunks every hop carries all steps' bytes and the slowest sets the pace, else the
    # chain pays the mean hop's transfer too, but never less than the slowest hop needs to
    # carry every step's segment (at 128+ ranks the chain alone was up to 1.44x optimistic in
    # the simulator). A hop's transfer is slowed by the other hops through its adapters.
    hops = _ring_hops(topo, tuple(range(p)) if order is None else order)
    m = nbytes / p
    latency = sum(topo.lat[j] for j, _ in hops) / p
    reduce = m * gamma
    slowest = max(m * share / topo.bw[j] for j, share in hops)
    steps = (p - 1) * (int(rs) + int(ag))
    if m > chunk_bytes:  # streaming: chunk k is reduced while chunk k+1 is on the wire
        rs_step = max(slowest, reduce)
        return (p - 1) * (int(rs) * (latency + rs_step) + int(ag) * (latency + slowest))
    transfer = sum(m * share / topo.bw[j] for j, share in hops) / p
    chain = (p - 1) * (int(rs) * (latency + transfer + reduce) + int(ag) * (latency + transfer))
    return max(chain, steps * slowest)


def in_rank_order(topo: Topology) -> bool:
    """Whether box order is rank order (ranks placed host by host): then mdring on a box of one
    dimension is exactly the ring."""
    return topo.order == tuple(range(topo.size))


def host_first(topo: Topology, order: tuple[int, ...] | None) -> bool:
    """Does mdring in this order run every host dimension before any network one (and has
    both)? Then its host phases can run through the boards (``ddlcore.paths.host_staged``)."""
    inside = [j < topo.host_dims for j in active_dims(topo, order)]
    return bool(inside) and inside[0] and not inside[-1] and inside == sorted(inside, reverse=True)


def _mdring(
    topo: Topology,
    nbytes: float,
    rs: bool,
    ag: bool,
    gamma: float,
    order: tuple[int, ...],
    chunk_bytes: float,
    host_path: bool = False,
    segments: int = 1,
) -> float:
    """mdring's phases one after another, or (``segments`` > 1, an allreduce) pipelined: every
    phase runs once per segment, phases on different links overlap, and a dimension's
    ``mdring.channels`` streams carry that many segments at once. After the first segment's
    pass the busiest link sets the pace: its bytes, or its phases' step chains (latency,
    transfer, reduction) shared among their streams, whichever is longer::

        T = sum_i t_i + (S - 1) * max over links of max(sum bytes_i / bw, sum t_i / streams_i)

    with t_i phase i's time on n / S bytes. A link is a host dimension's, or the network
    adapters, which every network dimension shares."""
    if len(active_dims(topo, order)) <= 1:  # one ring, in box order
        return _ring(topo, nbytes, rs, ag, gamma, chunk_bytes, topo.order)
    boards = host_path and rs and ag and host_first(topo, order)
    if not (rs and ag):
        segments = 1
    m = float(nbytes) / segments
    shared = topo.ranks_per_node > topo.adapters
    net_streams = max(
        [
            mdring.channels(topo.dims[j], shared)
            for j in active_dims(topo, order)
            if j >= topo.host_dims
        ]
        or [1]
    )  # the network dimensions share them
    chains: dict[int, float] = {}  # per link: its phases' times over their streams (a segment)
    wires: dict[int, float] = {}  # per link: the seconds its bytes take (one segment)
    total = 0.0
    for j in active_dims(topo, order):
        d = topo.dims[j]
        seg = m / d
        link = j if j < topo.host_dims else -1
        if boards and j < topo.host_dims:
            # Reduce-scatter and allgather halves on the boards, each two sync points; the
            # host-staged pipeline runs one segment at a time.
            t = wire = 4 * BOARD_SYNC_S + (d - 1) * seg * (2 / BOARD_BW + gamma)
            streams = 1
        else:
            share = _share(topo, j, topo.ranks_per_node)
            t = _phase(topo, j, (d - 1) * rs, seg, share, True, gamma, chunk_bytes) + _phase(
                topo, j, (d - 1) * ag, seg, share, False, gamma, chunk_bytes
            )
            wire = (d - 1) * (int(rs) + int(ag)) * seg * share / topo.bw[j]
            streams = net_streams if link < 0 else mdring.channels(d)
        total += t
        chains[link] = chains.get(link, 0.0) + t / streams
        wires[link] = wires.get(link, 0.0) + wire
        m = seg
    if segments == 1:
        return total
    return total + (segments - 1) * max(max(wires[link], chains[link]) for link in chains)


def host_segments(nbytes: int) -> int:
    """How many pipelined segments an allreduce of ``nbytes`` takes on the host-staged path
    (the same on every rank: a function of the size alone)."""
    return max(1, min(_HOST_SEGMENTS, int(nbytes) // _HOST_SEGMENT_BYTES))


def segment_counts(nbytes: float) -> list[int]:
    """The pipelined segment counts worth pricing for an allreduce of ``nbytes``."""
    return [s for s in SEGMENT_COUNTS if s == 1 or nbytes / s >= MIN_SEGMENT_BYTES]


def best_mdring(
    collective: str,
    topo: Topology,
    nbytes: float,
    order: tuple[int, ...],
    reduce_bw: float,
    host_path: bool,
    segments: int = 0,
) -> tuple[float, int]:
    """(predicted seconds, segments) of mdring in ``order``: ``segments`` if given (> 0),
    else the best count (the host-staged path's own where it runs)."""
    if collective != Collective.ALLREDUCE:
        counts = [1]
    elif host_path and host_first(topo, order):
        counts = [host_segments(int(nbytes))]
    else:
        counts = [segments] if segments > 0 else segment_counts(nbytes)
    return min(
        (
            predict(
                collective,
                "mdring",
                topo,
                nbytes,
                order,
                reduce_bw,
                host_path=host_path,
                segments=s,
            ),
            s,
        )
        for s in counts
    )


def _rhd(
    topo: Topology,
    nbytes: float,
    collective: str,
    gamma: float,
    doubling_only: bool,
    chunk_bytes: float,
) -> float:
    """Halving-doubling and recursive doubling, round by round as the schedules run them
    (`ddlcore.algorithms.halving_doubling`): allreduce halves nearest partners first and
    doubles back; reduce-scatter halves the largest distance first; allgather doubles from 1."""
    p2, extra = virtual_shape(topo.size)
    rs = collective in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER)
    ag = collective in (Collective.ALLREDUCE, Collective.ALLGATHER)
    t = 0.0
    if extra:  # fold and unfold: the even rank of each of the first pairs hands over everything
        t += _phase(
            topo, topo.dim_between(0, 1), int(rs) + int(ag), nbytes, 1, rs, gamma, chunk_bytes
        )
    near = [1 << i for i in range(p2.bit_length() - 1)]

    def real(v: int) -> int:  # the rank virtual rank v runs on (halving_doubling._Fold.real)
        return 2 * v + 1 if v < extra else v + extra

    def dim_of(d: int) -> int:  # the slowest link any pair of the round crosses
        return max(topo.dim_between(real(v), real(v ^ d)) for v in range(p2))

    def cost(d: int, m: float, reduce: bool) -> float:
        return _phase(
            topo,
            dim_of(d),
            1,
            m,
            _share(topo, dim_of(d), topo.ranks_per_node),
            reduce,
            gamma,
            chunk_bytes,
        )

    if doubling_only:
        return t + sum(cost(d, nbytes, True) for d in near)
    halves = [nbytes / 2 ** (i + 1) for i in range(len(near))]  # n/2, n/4, ... per round
    if collective == Collective.ALLREDUCE:
        t += sum(cost(d, m, True) for d, m in zip(near, halves, strict=True))
        t += sum(cost(d, m, False) for d, m in zip(near, halves, strict=True))
    elif collective == Collective.REDUCE_SCATTER:
        t += sum(cost(d, m, True) for d, m in zip(near[::-1], halves, strict=True))
    else:
        t += sum(cost(d, m, False) for d, m in zip(near, halves[::-1], strict=True))
    return t


def model_bytes(collective: str, in_bytes: int, size: int) -> int:
    """The size the cost model reads for a call with ``in_bytes`` of input on each of ``size``
    ranks: the allreduce / reduce_scatter input, the allgather output (nccl-tests' size)."""
    return in_bytes * size if collective == Collective.ALLGATHER else in_bytes


def predict(
    collective: str,
    algorithm: str,
    topo: Topology,
    nbytes: float,
    dim_order: tuple[int, ...] | None = None,
    reduce_bw: float = REDUCE_BW,
    chunk_bytes: float = CHUNK_BYTES,
    host_path: bool = False,
    segments: int = 1,
) -> float:
    """Predicted seconds of ``collective`` moving ``nbytes`` (the allreduce / reduce_scatter
    input, the allgather output) with ``algorithm`` on ``topo``; ``host_path``: an allreduce's
    host dimensions may run through the boards (mdring); ``segments``: mdring's allreduce
    pipelined in that many."""
    gamma = 1.0 / reduce_bw
    rs = collective in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER)
    ag = collective in (Collective.ALLREDUCE, Collective.ALLGATHER)
    if algorithm == "ring":
        return _ring(topo, nbytes, rs, ag, gamma, chunk_bytes)
    if algorithm == "mdring":
        order = tuple(range(len(topo.dims))) if dim_order is None else dim_order
        return _mdring(topo, nbytes, rs, ag, gamma, order, chunk_bytes, host_path, segments)
    if algorithm == "rhd":
        return _rhd(topo, nbytes, collective, gamma, False, chunk_bytes)
    if algorithm == "rd":
        return _rhd(topo, nbytes, collective, gamma, True, chunk_bytes)
    raise ValueError(f"no cost model for algorithm {algorithm!r}")


def dim_orders(topo: Topology) -> list[tuple[int, ...]]:
    """mdring phase orders auto tries: every permutation of a small box, else fastest first."""
    k = len(topo.dims)
    if k > MAX_PERMUTED_DIMS:
        return [tuple(range(k))]
    return list(itertools.permutations(range(k)))


def candidates(
    collective: str, topo: Topology, nbytes: float, host_path: bool = False, segments: int = 0
) -> list[Choice]:
    """Every (algorithm, dimension order) for ``collective`` with its predicted time, best
    first; mdring with its best segment count (or ``segments``, if > 0)."""
    out = []
    for name in ALGORITHMS[collective]:
        if name == "mdring":
            if len(active_dims(topo)) <= 1:
                if not in_rank_order(topo):  # the ring in box order, not rank order
                    out.append(Choice(name, 0, None, predict(collective, name, topo, nbytes)))
                continue  # in rank order, a box with one dimension makes mdring the ring
            for order in dim_orders(topo):
                t, nseg = best_mdring(
                    collective, topo, nbytes, order, REDUCE_BW, host_path, segments
                )
                out.append(Choice(name, 0, order, t, segments=nseg))
        else:
            out.append(Choice(name, 0, None, predict(collective, name, topo, nbytes)))
    # Ties go to the registry's order (the simplest first).
    return sorted(out, key=lambda c: c.predicted_s)


def choose(
    collective: str,
    topo: Topology,
    nbytes: int,
    algo: str,
    chunk_bytes: int,
    host_path: bool = False,
    segments: int = 0,
) -> Choice:
    """The algorithm for one call: ``algo`` if named and ``collective`` has it (``rd`` is an
    allreduce only: the other collectives then take the cost model's choice), else the lowest
    predicted time (``host_path``: as `predict`; ``segments`` > 0: mdring's allreduce in that
    many pipelined segments, else the cost model's count)."""
    candidates_of = ALGORITHMS[collective]
    if collective not in SELECTABLE:
        return Choice(next(iter(candidates_of)), chunk_bytes)
    if algo != "auto" and algo in candidates_of:
        if algo == "mdring" and len(active_dims(topo)) > 1:
            best = min(
                (
                    c
                    for c in candidates(collective, topo, nbytes, host_path, segments)
                    if c.algorithm == algo
                ),
                key=lambda c: c.predicted_s,
            )
            return dataclasses.replace(best, chunk_bytes=chunk_bytes)
        if algo == "mdring":  # one ring in box order, whatever the order of the dimensions
            return min(
                (
                    Choice(
                        "mdring",
                        chunk_bytes,
                        order,
                        predict(collective, algo, topo, nbytes, order, host_path=host_path),
                    )
                    for order in dim_orders(topo)
                ),
                key=lambda c: c.predicted_s,
            )
        return Choice(algo, chunk_bytes, None, predict(collective, algo, topo, nbytes))
    ranked = candidates(collective, topo, nbytes, host_path, segments)
    # Within TIE of the best, the simplest (registry order: ring, mdring, rhd, rd) wins; but
    # where ranks are not placed host by host, the ring in box order (mdring) goes before the
    # ring in rank order: it never crosses more host boundaries, and a flat box (uneven hosts)
    # cannot price the boundaries the rank-order ring crosses.
    order = list(candidates_of)
    if not in_rank_order(topo) and "mdring" in order:
        order.remove("mdring")
        order.insert(0, "mdring")
    near = [c for c in ranked if c.predicted_s <= ranked[0].predicted_s * (1 + TIE)]
    best = min(near, key=lambda c: order.index(c.algorithm))
    return dataclasses.replace(best, chunk_bytes=chunk_bytes)
