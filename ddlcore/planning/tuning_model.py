"""The cost model: an alpha-beta-gamma price of each algorithm's schedule on a topology
(`predict`), phase by phase as the schedules run, and the link model the simulator
(`ddlcore.simulate`) shares. `ddlcore.planning.tuning` chooses among the algorithms by these prices.

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
`ddlcore.algorithms.mdring`); `_mdring` prices it (`ddlcore.planning.tuning` picks the segment count with
the order; ``DDL_SEGMENTS`` overrides the count).
"""

from __future__ import annotations

from ddlcore.algorithms import mdring
from ddlcore.algorithms.halving_doubling import virtual_shape
from ddlcore.algorithms.mdring import active_dims
from ddlcore.collectives import Collective
from ddlcore.topology import Topology

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
    both)? Then its host phases can run through the boards (``ddlcore.execution.paths.host_staged``)."""
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
    if not (rs and ag):
        segments = 1
    total, paces = _mdring_pass(
        topo, float(nbytes) / segments, rs, ag, gamma, order, chunk_bytes, host_path
    )
    return total + (segments - 1) * max(paces.values()) if segments > 1 else total


def _mdring_pass(
    topo: Topology,
    nbytes: float,
    rs: bool,
    ag: bool,
    gamma: float,
    order: tuple[int, ...],
    chunk_bytes: float,
    host_path: bool,
) -> tuple[float, dict[int, float]]:
    """One segment of ``nbytes`` through mdring's phases: (their total time, each link's pace:
    the seconds it is busy with the segment, its bytes or its phases' chains over their
    streams, whichever is longer; link -1 is the network adapters)."""
    boards = host_path and rs and ag and host_first(topo, order)
    m = nbytes
    shared = topo.ranks_per_node > topo.adapters
    net_streams = max(
        [
            mdring.channels(topo.dims[j], shared)
            for j in active_dims(topo, order)
            if j >= topo.host_dims
        ]
        or [1]
    )  # the network dimensions share them
    chains: dict[int, float] = {}  # per link: its phases' times over their streams
    wires: dict[int, float] = {}  # per link: the seconds its bytes take
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
    return total, {link: max(wires[link], chains[link]) for link in chains}


def pipeline_lead(
    topo: Topology,
    nbytes: float,
    order: tuple[int, ...],
    reduce_bw: float = REDUCE_BW,
    chunk_bytes: float = CHUNK_BYTES,
) -> float:
    """How far the busiest link of mdring's allreduce pipeline leads the others: its pace per
    segment of ``nbytes`` over the next busiest link's. Where it leads by far, the segments
    queue behind that one link as `_mdring` says; where two links are close, segments of
    different phases meet at the ports in an order the formula does not price
    (`ddlcore.planning.tuning.segment_counts`), and where one link carries every phase (the
    network dimensions of a box without a host one) they all meet at its ports: no lead, 1."""
    if len(active_dims(topo, order)) <= 1:
        return 1.0
    _, paces = _mdring_pass(topo, nbytes, True, True, 1.0 / reduce_bw, order, chunk_bytes, False)
    ranked = sorted(paces.values(), reverse=True)
    if len(ranked) < 2 or ranked[1] <= 0.0:
        return 1.0
    return ranked[0] / ranked[1]


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
