"""Collectives across hosts whose host dimensions run through the boards (``hostcoll``): mdring
with every host dimension before the network ones, the host phases as native calls among the
host's M ranks and the network phases as rings (schedules) among the H ranks that share a host
position. The communicator takes this path where the tuner picked such an mdring
(`Communicator._host_stage`); everything here runs on host memory (device buffers arrive
staged).

* **allreduce**: each local rank reduces its part of the host's inputs (``RS_PART``), the rings
  allreduce that part across hosts, the local ranks read each other's parts back (``AG_PART``).
  From ``tuning._HOST_SEGMENT_BYTES`` x 2 on, in segments: the boards work on one segment while
  another crosses the network (``ddlcore.pipeline``).
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

import functools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ddlcore import engine, hostcoll, pipeline, tuning
from ddlcore.algorithms import mdring
from ddlcore.algorithms.schedule import split
from ddlcore.calls import Call
from ddlcore.topology import Topology
from ddlcore.tuning import host_segments

if TYPE_CHECKING:
    from ddlcore.communicator import Communicator

COLLECTIVES = ("allreduce", "reduce_scatter", "allgather")


def board_bytes(collective: str, nbytes: int, topo: Topology) -> int:
    """Input bytes of the host phase's board call for a ``collective`` of ``nbytes`` of input
    where it makes one (one call per network position makes smaller ones): whether the path
    is open at all (too large for the slots with direct reads off: no), the same on every
    rank."""
    if collective == "allgather":  # the boards spread each local rank's H blocks
        return nbytes * (topo.size // topo.ranks_per_node)
    return nbytes


def allreduce(comm: Communicator, call: Call, seq: int, host_in: np.ndarray | None,
              host_out: np.ndarray, itemsize: int, choice: tuning.Choice) -> None:
    """Allreduce as mdring whose host dimensions run through this host's boards: each local
    rank reduces its part of the host's inputs (boards), the rings across hosts allreduce
    that part (schedules over the network links), then the local ranks copy each other's
    parts (boards); segment by segment, pipelined, for large calls (`host_segments`)."""
    node = comm._node
    assert node is not None
    segments = split(call.count, host_segments(call.count * itemsize))
    flat_out = host_out.reshape(-1)

    def on_boards(kind: str, s: int) -> None:  # RS_PART or AG_PART of segment s
        comm._run_boards(node, kind, call, seq, host_in, host_out, itemsize,
                         node.mode(segments[s][1] * itemsize), 0, segments[s])

    reduce_scatter = functools.partial(on_boards, hostcoll.RS_PART)
    allgather = functools.partial(on_boards, hostcoll.AG_PART)

    deadline = time.monotonic() + comm.timeout  # the network phase's, all segments'

    def across(s: int) -> None:
        start, count = segments[s]
        off, length = split(count, node.size)[node.rank]
        part = flat_out[start + off:start + off + length]
        comm._run_schedule(call, seq, part, part, itemsize,
                           comm._schedule_across("allreduce", length, itemsize, choice, s == 0,
                                                call.count),
                           max(0.0, deadline - time.monotonic()))

    if len(segments) == 1:
        reduce_scatter(0)
        comm._on_boards = False
        across(0)
        allgather(0)
        return

    def abort(exc: BaseException) -> None:  # both paths: the other stage must fail fast
        code, reason = engine.abort_code(exc), engine.failure_reason(exc)
        node.abort(code, reason)
        if comm._links is not None:
            comm._links.abort(code, reason)

    # Segment s crosses the network while the boards reduce s+1 and spread s-1. Every
    # segment's rings use the call's tags: a pair's messages with one tag are matched in
    # order, and this rank starts segment s+1's rings only after s's.
    pipeline.run(len(segments), reduce_scatter, across, allgather, abort, comm.timeout,
                 f"ddlcore-rank{comm.rank}-network",
                 f"rank {comm.rank}: {comm._label(call, seq)}")


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
    if all(at[lpos * nets + q] == firsts[q] + lpos for q in range(nets)
           for lpos in range(per_node)):
        return _Arrangement(groups=firsts, blocks=tuple(blocks))
    return _Arrangement(blocks=tuple(blocks))


def _per_position(how: _Arrangement, nets: int, nbytes: int) -> tuple[int, ...] | None:
    """``how.groups`` where one board call per network position (2 sync points each) is
    cheaper than one call over a copy of the ``nbytes`` by the tuner's board constants (from
    ~160 KB at 2 hosts, from ~5 MB at 64); else None. The same on every rank of a host."""
    if 2 * nets * tuning.BOARD_SYNC_S <= nbytes / tuning.BOARD_BW:
        return how.groups
    return None


def _copy_blocks(src: np.ndarray, dst: np.ndarray, places: tuple[int, ...],
                 to_places: bool) -> None:
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


def reduce_scatter(comm: Communicator, call: Call, seq: int, host_in: np.ndarray | None,
                   host_out: np.ndarray, itemsize: int, choice: tuning.Choice) -> None:
    """Reduce-scatter: the boards reduce-scatter the blocks among the host's ranks (local rank
    l keeps, summed over this host, the blocks of the ranks at host position l), the rings
    reduce-scatter those across hosts (each rank keeps its own)."""
    node = comm._node
    assert node is not None and host_in is not None
    nets, k = comm.size // node.size, call.count // comm.size
    how = _arrangement(comm.topology, choice.dim_order)
    part = comm._stage_buffer("part", nets * k * itemsize).view(host_in.dtype)
    groups = _per_position(how, nets, host_in.nbytes)
    if groups is not None:
        flat = host_in.reshape(-1)  # network position q's blocks lie together in the input
        mode = node.mode(node.size * k * itemsize)
        for q, first in enumerate(groups):
            comm._run_boards(node, "reduce_scatter", call, seq,
                             flat[first * k:(first + node.size) * k], part[q * k:(q + 1) * k],
                             itemsize, mode, 0, (0, node.size * k), own_buffers=True)
    else:
        stage = host_in
        if how.blocks is not None:
            stage = comm._stage_buffer("stage", host_in.nbytes).view(host_in.dtype)
            _copy_blocks(host_in, stage, how.blocks, to_places=True)
        comm._run_boards(node, "reduce_scatter", call, seq, stage, part, itemsize,
                         node.mode(call.count * itemsize), 0, own_buffers=True)
    comm._on_boards = False
    comm._run_schedule(call, seq, part, host_out, itemsize,
                       comm._schedule_across("reduce_scatter", nets * k, itemsize, choice,
                                             True, call.count))


def allgather(comm: Communicator, call: Call, seq: int, host_in: np.ndarray | None,
              host_out: np.ndarray, itemsize: int, choice: tuning.Choice) -> None:
    """Allgather: the rings allgather the blocks of the ranks at this host position across
    hosts, then the boards allgather those parts among the host's ranks, in rank order."""
    node = comm._node
    assert node is not None and host_in is not None
    nets, k = comm.size // node.size, call.count
    part = comm._stage_buffer("part", nets * k * itemsize).view(host_in.dtype)
    comm._sync_node(call, seq, itemsize)  # compared on this host before the network phase
    comm._run_schedule(call, seq, host_in, part, itemsize,
                       comm._schedule_across("allgather", k, itemsize, choice, True,
                                             call.count))
    how = _arrangement(comm.topology, choice.dim_order)
    groups = _per_position(how, nets, host_out.nbytes)
    if groups is not None:
        flat = host_out.reshape(-1)
        mode = node.mode(k * itemsize)
        for q, first in enumerate(groups):
            comm._run_boards(node, "allgather", call, seq, part[q * k:(q + 1) * k],
                             flat[first * k:(first + node.size) * k], itemsize, mode, 0,
                             (0, k), own_buffers=True)
        return
    stage = host_out
    if how.blocks is not None:
        stage = comm._stage_buffer("stage", host_out.nbytes).view(host_out.dtype)
    comm._run_boards(node, "allgather", call, seq, part, stage, itemsize,
                     node.mode(nets * k * itemsize), 0, (0, nets * k), own_buffers=True)
    if how.blocks is not None:
        _copy_blocks(stage, host_out, how.blocks, to_places=False)


RUN = {"allreduce": allreduce, "reduce_scatter": reduce_scatter, "allgather": allgather}
