"""Collectives across hosts whose host dimensions run through the boards (``hostcoll``): mdring
with every host dimension before the network ones, the host phases as native calls among the
host's M ranks and the network phases as rings (schedules) among the H ranks that share a host
position. `HostStagedPath` takes a call where the tuner picks such an mdring (`choice`);
everything here runs on host memory (device buffers arrive staged).

* **allreduce**: each local rank reduces its part of the host's inputs (``HOST_REDUCE_SCATTER``),
  the rings allreduce that part across hosts, the local ranks read each other's parts back
  (``HOST_ALLGATHER``).
  From ``tuning._HOST_SEGMENT_BYTES`` x 2 on, in segments: the boards work on one segment while
  another crosses the network (``ddlcore.execution.pipeline``).
* **reduce_scatter** and **allgather**: the host phase gives each local rank, summed over the
  host (reduce-scatter), the blocks of the H ranks at its host position, one per network
  position (`mdring.host_staged_blocks`), and the rings across hosts reduce-scatter those H
  blocks (allgather: the rings first, then the boards). Dealt round-robin over the hosts, the
  blocks already lie in that order: one board call. Placed host by host, one board call per
  network position works on the caller's buffers, where its sync points cost less than a
  copy (`_per_position`); otherwise the blocks are copied into or out of a staging buffer
  (n bytes, locally) around one board call.

      reduce-scatter, n = P x k, box M x H (host by host):    allgather, the reverse:
        for each network position q (H board calls):           rings AG across hosts:
          boards RS of the M blocks of q's ranks:                own block -> part (H x k)
          local rank l keeps block (l, q) summed over          for each network position q:
          the host, at part[q]  (n (M-1)/M read per rank)        boards AG of part[q] into
        rings RS across hosts: part (H x k) -> own block          the M blocks of q's ranks

  Per host link that is (H-1)/H n bytes out and in, the reduce-scatter's (allgather's) bound;
  the host phase and the rings run one after the other (no segments, unlike allreduce).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from dataclasses import dataclass

import numpy as np

from ddlcore.algorithms import Schedule, agreement, mdring
from ddlcore.algorithms.schedule import split
from ddlcore.calls import Call
from ddlcore.collectives import Collective
from ddlcore.execution import engine, hostcoll, pipeline
from ddlcore.execution.hostcoll import BoardKind, HostCollectives
from ddlcore.execution.paths.base import HOST_STAGED, Context, PathBase, Plan, board_bytes, label
from ddlcore.planning import tuning
from ddlcore.planning.tuning import host_segments
from ddlcore.topology import Topology
from ddlcore.transports.common import abort_code

NAME = "host-staged"
COLLECTIVES = HOST_STAGED
__all__ = ["COLLECTIVES", "RUN", "HostStagedPath", "board_bytes", "host_segments"]


class HostStagedPath(PathBase):
    """mdring whose host dimensions run through this host's boards (``node``), its network
    dimensions as rings over the links. Owns its caches: the choice by (collective, bytes),
    the rings across hosts by shape, and its staging buffers."""

    name = NAME

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.choice = functools.lru_cache(maxsize=256)(self._choice)
        self.across = functools.lru_cache(maxsize=256)(self._across)
        # Buffers by name, kept (and grown, never shrunk) for the communicator's life: the
        # network rings' part (H/P of a call) and, for irregular placements, a copy.
        self._stage: dict[str, np.ndarray] = {}

    @property
    def node(self) -> HostCollectives:
        assert self.ctx.node is not None
        return self.ctx.node

    def plan(self, call: Call) -> Plan | None:
        if self.ctx.node is None:
            return None
        itemsize = call.inp.dtype.itemsize if call.inp is not None else 1
        choice = self.choice(call.collective, call.count * itemsize)
        return Plan(itemsize, choice=choice) if choice is not None else None

    def _choice(self, collective: Collective, nbytes: int) -> tuning.Choice | None:
        """The choice when a collective of ``nbytes`` of input runs as mdring with its host
        dimensions through this host's boards; None when it runs as a schedule (also where its
        board calls would be too large for the slots and direct reads are off)."""
        ctx = self.ctx
        if ctx.node is None or collective not in COLLECTIVES:
            return None
        mode = ctx.node.mode(board_bytes(collective, nbytes, ctx.topology))
        choice = ctx.choose(collective, nbytes)
        if (
            mode == hostcoll.SYNC_ONLY
            or choice.algorithm != mdring.NAME
            or not tuning.host_first(ctx.topology, choice.dim_order)
        ):
            return None
        return dataclasses.replace(choice, host_path=hostcoll.NAME)

    def _across(
        self,
        collective: Collective,
        count: int,
        itemsize: int,
        choice: tuning.Choice,
        first: bool = True,
        call_count: int = 1,
    ) -> tuple[tuning.Choice, Schedule]:
        """The rings across hosts on ``count`` elements; ``first``: the call's first network
        phase (it makes first contact, see `agreement`); ``call_count``: the call's element
        count (an empty call adds the agreement's rounds)."""
        ctx = self.ctx
        make = {
            Collective.ALLREDUCE: mdring.allreduce_across_hosts,
            Collective.REDUCE_SCATTER: mdring.reduce_scatter_across_hosts,
            Collective.ALLGATHER: mdring.allgather_across_hosts,
        }[collective]
        return choice, agreement.agreed(
            lambda r: make(
                r, ctx.size, count, itemsize, choice.chunk_bytes, ctx.topology, choice.dim_order
            ),
            ctx.rank,
            ctx.size,
            call_count > 0,
            first,
        )

    def stage_buffer(self, name: str, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory kept for this path (``name`` tells apart the buffers one
        call uses at once)."""
        buf = self._stage.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._stage[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _run(self, plan: Plan, call: Call, seq: int) -> None:
        assert plan.choice is not None
        choice = plan.choice

        def run(host_in: np.ndarray | None, host_out: np.ndarray | None) -> None:
            assert host_out is not None
            RUN[call.collective](self, call, seq, host_in, host_out, plan.itemsize, choice)

        self.in_host_memory(call, run)

    def close(self) -> None:
        self.choice.cache_clear()
        self.across.cache_clear()
        self._stage.clear()


def allreduce(
    path: HostStagedPath,
    call: Call,
    seq: int,
    host_in: np.ndarray | None,
    host_out: np.ndarray,
    itemsize: int,
    choice: tuning.Choice,
) -> None:
    """Allreduce as mdring whose host dimensions run through this host's boards: each local
    rank reduces its part of the host's inputs (boards), the rings across hosts allreduce
    that part (schedules over the network links), then the local ranks copy each other's
    parts (boards); segment by segment, pipelined, for large calls (`host_segments`)."""
    node, ctx = path.node, path.ctx
    segments = split(call.count, host_segments(call.count * itemsize))
    flat_out = host_out.reshape(-1)

    def on_boards(kind: BoardKind, s: int) -> None:  # the host phases of segment s
        path.on_boards(
            node,
            call,
            seq,
            host_in,
            host_out,
            itemsize,
            node.mode(segments[s][1] * itemsize),
            kind=kind,
            segment=segments[s],
        )

    reduce_scatter = functools.partial(on_boards, BoardKind.HOST_REDUCE_SCATTER)
    allgather = functools.partial(on_boards, BoardKind.HOST_ALLGATHER)

    deadline = time.monotonic() + ctx.timeout  # the network phase's, all segments'

    def across(s: int) -> None:
        start, count = segments[s]
        off, length = split(count, node.size)[node.rank]
        part = flat_out[start + off : start + off + length]
        path.on_links(
            call,
            seq,
            path.across(Collective.ALLREDUCE, length, itemsize, choice, s == 0, call.count),
            part,
            part,
            itemsize,
            max(0.0, deadline - time.monotonic()),
        )

    if len(segments) == 1:
        reduce_scatter(0)
        across(0)
        allgather(0)
        return

    def abort(exc: BaseException) -> None:  # both paths: the other stage must fail fast
        code, reason = abort_code(exc), engine.failure_reason(exc)
        node.abort(code, reason)
        if ctx.links is not None:
            ctx.links.abort(code, reason)

    # Segment s crosses the network while the boards reduce s+1 and spread s-1. Every
    # segment's rings use the call's tags: a pair's messages with one tag are matched in
    # order, and this rank starts segment s+1's rings only after s's.
    pipeline.run(
        len(segments),
        reduce_scatter,
        across,
        allgather,
        abort,
        ctx.timeout,
        f"ddlcore-rank{ctx.rank}-network",
        f"rank {ctx.rank}: {label(call, seq)}",
    )


@dataclass(frozen=True)
class _Arrangement:
    """How the ranks' blocks map onto host-staged order (`mdring.host_staged_blocks`):
    ``blocks`` = each rank's place there (None: the same order, no copy needed); ``groups`` =
    the first rank of each network position's M consecutive ranks, where each network
    position's ranks are consecutive in rank order (placed host by host): then one board call
    per network position can work on the caller's buffer instead of a copy."""

    groups: tuple[int, ...] | None = None
    blocks: tuple[int, ...] | None = None


@functools.lru_cache(maxsize=64)
def _arrangement(topo: Topology, dim_order: tuple[int, ...] | None) -> _Arrangement:
    blocks = mdring.host_staged_blocks(topo, dim_order)
    if blocks == list(range(topo.size)):  # ranks dealt round-robin over the hosts
        return _Arrangement()
    per_node, nets = topo.ranks_per_node, topo.size // topo.ranks_per_node
    at = sorted(range(topo.size), key=blocks.__getitem__)  # the rank at each place
    firsts = tuple(at[q] for q in range(nets))
    if all(
        at[lpos * nets + q] == firsts[q] + lpos for q in range(nets) for lpos in range(per_node)
    ):
        return _Arrangement(groups=firsts, blocks=tuple(blocks))
    return _Arrangement(blocks=tuple(blocks))


def _per_position(how: _Arrangement, nets: int, nbytes: int) -> tuple[int, ...] | None:
    """``how.groups`` where one board call per network position (2 sync points each) is
    cheaper than one call over a copy of the ``nbytes`` by the tuner's board constants (from
    ~160 KB at 2 hosts, from ~5 MB at 64); else None. The same on every rank of a host."""
    if 2 * nets * tuning.BOARD_SYNC_S <= nbytes / tuning.BOARD_BW:
        return how.groups
    return None


def _copy_blocks(
    src: np.ndarray, dst: np.ndarray, places: tuple[int, ...], to_places: bool
) -> None:
    """Block r of ``src`` to place ``places[r]`` of ``dst`` (``to_places``), or back. Row by
    row: np.take with out= moved ~4x slower than memcpy here."""
    size = len(places)
    a = src.reshape(-1).view(np.uint8).reshape(size, -1)
    b = dst.reshape(-1).view(np.uint8).reshape(size, -1)
    for r, place in enumerate(places):
        if to_places:
            b[place] = a[r]
        else:
            b[r] = a[place]


def reduce_scatter(
    path: HostStagedPath,
    call: Call,
    seq: int,
    host_in: np.ndarray | None,
    host_out: np.ndarray,
    itemsize: int,
    choice: tuning.Choice,
) -> None:
    """Reduce-scatter: the boards reduce-scatter the blocks among the host's ranks (local rank
    l keeps, summed over this host, the blocks of the ranks at host position l), the rings
    reduce-scatter those across hosts (each rank keeps its own)."""
    node, ctx = path.node, path.ctx
    assert host_in is not None
    nets, k = ctx.size // node.size, call.count // ctx.size
    how = _arrangement(ctx.topology, choice.dim_order)
    part = path.stage_buffer("part", nets * k * itemsize).view(host_in.dtype)
    groups = _per_position(how, nets, host_in.nbytes)
    if groups is not None:
        flat = host_in.reshape(-1)  # network position q's blocks lie together in the input
        mode = node.mode(node.size * k * itemsize)
        for q, first in enumerate(groups):
            path.on_boards(
                node,
                call,
                seq,
                flat[first * k : (first + node.size) * k],
                part[q * k : (q + 1) * k],
                itemsize,
                mode,
                segment=(0, node.size * k),
                own_buffers=True,
            )
    else:
        stage = host_in
        if how.blocks is not None:
            stage = path.stage_buffer("stage", host_in.nbytes).view(host_in.dtype)
            _copy_blocks(host_in, stage, how.blocks, to_places=True)
        path.on_boards(
            node,
            call,
            seq,
            stage,
            part,
            itemsize,
            node.mode(call.count * itemsize),
            own_buffers=True,
        )
    path.on_links(
        call,
        seq,
        path.across(Collective.REDUCE_SCATTER, nets * k, itemsize, choice, True, call.count),
        part,
        host_out,
        itemsize,
    )


def allgather(
    path: HostStagedPath,
    call: Call,
    seq: int,
    host_in: np.ndarray | None,
    host_out: np.ndarray,
    itemsize: int,
    choice: tuning.Choice,
) -> None:
    """Allgather: the rings allgather the blocks of the ranks at this host position across
    hosts, then the boards allgather those parts among the host's ranks, in rank order."""
    node, ctx = path.node, path.ctx
    assert host_in is not None
    nets, k = ctx.size // node.size, call.count
    part = path.stage_buffer("part", nets * k * itemsize).view(host_in.dtype)
    # compared on this host before the network phase
    path.on_boards(node, call, seq, None, None, itemsize, hostcoll.SYNC_ONLY)
    path.on_links(
        call,
        seq,
        path.across(Collective.ALLGATHER, k, itemsize, choice, True, call.count),
        host_in,
        part,
        itemsize,
    )
    how = _arrangement(ctx.topology, choice.dim_order)
    groups = _per_position(how, nets, host_out.nbytes)
    if groups is not None:
        flat = host_out.reshape(-1)
        mode = node.mode(k * itemsize)
        for q, first in enumerate(groups):
            path.on_boards(
                node,
                call,
                seq,
                part[q * k : (q + 1) * k],
                flat[first * k : (first + node.size) * k],
                itemsize,
                mode,
                segment=(0, k),
                own_buffers=True,
            )
        return
    stage = host_out
    if how.blocks is not None:
        stage = path.stage_buffer("stage", host_out.nbytes).view(host_out.dtype)
    path.on_boards(
        node,
        call,
        seq,
        part,
        stage,
        itemsize,
        node.mode(nets * k * itemsize),
        segment=(0, nets * k),
        own_buffers=True,
    )
    if how.blocks is not None:
        _copy_blocks(stage, host_out, how.blocks, to_places=False)


RUN = {
    Collective.ALLREDUCE: allreduce,
    Collective.REDUCE_SCATTER: reduce_scatter,
    Collective.ALLGATHER: allgather,
}
