"""What the execution paths share: the `Path` protocol the communicator walks (the first path
whose `plan` accepts a call runs it), the `Context` of one communicator the paths are built on
(ranks, links, boards, tuner settings and host staging, passed explicitly), and `PathBase`, the
steps more than one path takes: a board call, a schedule on host memory, device buffers staged
through host memory, and on failure telling the peers the failing step did not reach."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ddlcore import device
from ddlcore.algorithms import Buf, Schedule
from ddlcore.buffers import MemoryKind
from ddlcore.calls import Call
from ddlcore.collectives import HAS_ROOT, Collective
from ddlcore.execution import _frontend, engine, hostcoll, int_avg
from ddlcore.execution.check_words import describe_check
from ddlcore.execution.hostcoll import BoardCall, BoardKind, HostCollectives
from ddlcore.job.links import Links
from ddlcore.kernels.cpu import array_address
from ddlcore.ops import Op
from ddlcore.planning import tuning
from ddlcore.topology import Topology

log = logging.getLogger("ddlcore")

# The collectives whose host dimensions can run through the boards (`ddlcore.execution.paths.host_staged`).
HOST_STAGED = (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER)
# The collectives the boards run (the others only meet there at a sync point, then run as
# schedules: reduce, gather, scatter, alltoall, alltoallv).
ON_BOARDS = (*HOST_STAGED, Collective.BROADCAST, Collective.BARRIER)


@dataclass(frozen=True)
class Plan:
    """How a path runs one call: ``itemsize`` of its elements; ``mode`` how this host's boards
    of a one-host communicator take a call of its size (`hostcoll.SLOTS`, `DIRECT`,
    `SYNC_ONLY`; None without them); ``choice`` the tuner's choice where accepting needed one."""

    itemsize: int
    mode: int | None = None
    choice: tuning.Choice | None = None


class Path(Protocol):
    """One way to run a collective (Horovod's op managers: ``Enabled()``, then ``Execute()``)."""

    name: str

    def plan(self, call: Call) -> Plan | None:
        """How this path would run ``call``, or None where it does not take it."""

    def run(self, plan: Plan, call: Call, seq: int) -> None:
        """Run ``call`` (the communicator's ``seq``-th) as planned; raises a `DDLError`."""

    def abort(self, code: int, reason: str) -> None:
        """After a failure: tell the peers of the call in progress here (if any) that the
        failing step did not tell."""

    def close(self) -> None:
        """Release what the path keeps between calls."""


def board_mode(ctx: Context, call: Call, itemsize: int) -> int | None:
    """How a one-host communicator's boards take ``call`` (None without them): by its size,
    or `hostcoll.SYNC_ONLY` for the collectives they do not run (`ON_BOARDS`), so the ranks
    compare their calls there before the schedule."""
    host = ctx.host
    if host is None:
        return None
    if call.collective not in ON_BOARDS:
        return hostcoll.SYNC_ONLY
    return host.mode(call.count * itemsize)


def board_bytes(collective: str, nbytes: int, topo: Topology) -> int:
    """Input bytes of the host phase's board call for a ``collective`` of ``nbytes`` of input
    where it makes one (one call per network position makes smaller ones): whether the path
    is open at all (too large for the slots with direct reads off: no), the same on every
    rank."""
    if collective == Collective.ALLGATHER:  # the boards spread each local rank's H blocks
        return nbytes * (topo.size // topo.ranks_per_node)
    return nbytes


@dataclass
class Context:
    """One communicator as its paths see it. ``host``: the boards of a communicator whose ranks
    all share this host; ``node``: this host's ranks' boards when there are other hosts (never
    both). The paths borrow the links and boards; the communicator closes them."""

    rank: int
    size: int
    topology: Topology
    links: Links | None
    timeout: float
    depth: int  # DDL_PIPELINE_DEPTH
    debug: bool  # DDL_DEBUG
    algo: str
    chunk_bytes: int
    segments: int  # DDL_SEGMENTS
    host: HostCollectives | None = None
    node: HostCollectives | None = None
    device_chunk_bytes: int = 0  # device schedules' chunk (0: chunk_bytes)
    staging: engine.StagingPool = field(default_factory=engine.StagingPool)
    _scratch: np.ndarray = field(default_factory=lambda: np.empty(0, np.uint8))
    _pinned: Any = None

    @property
    def boards(self) -> HostCollectives | None:
        return self.host or self.node

    def choose(
        self, collective: Collective, nbytes: int, chunk_bytes: int | None = None
    ) -> tuning.Choice:
        """The tuner's choice for ``nbytes`` of input (the cost model reads an allgather's
        output), pipelined in chunks of ``chunk_bytes`` (default: the context's)."""
        boards = (
            self.node is not None
            and collective in HOST_STAGED
            and self.node.mode(board_bytes(collective, nbytes, self.topology)) != hostcoll.SYNC_ONLY
        )
        return tuning.choose(
            collective,
            self.topology,
            tuning.model_bytes(collective, nbytes, self.size),
            self.algo,
            chunk_bytes or self.chunk_bytes,
            boards,
            self.segments,
        )

    def scratch_region(self, nbytes: int) -> engine.Region:
        """A schedule's scratch buffer on host memory (kept, grown, for later calls)."""
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return engine.Region.of(self._scratch[:nbytes])

    def pinned(self) -> device.DeviceStaging:
        """The pinned host buffers device buffers pass through on the board paths."""
        if self._pinned is None:
            self._pinned = device.DeviceStaging()
        return self._pinned

    def host_arrays(self, call: Call) -> tuple[np.ndarray, np.ndarray]:
        """The host memory the boards or the engine work on for device buffers: pinned copies
        (the input downloaded now; the output uploaded after the call ran)."""
        assert call.inp is not None and call.out is not None
        stage = self.pinned()
        if call.ready is not None:
            call.ready.synchronize()
        host_in = stage.download(call.inp.array, "in", call.inp.dtype, call.inp.count)
        if call.out.ptr == call.inp.ptr and call.out.count == call.inp.count:
            return host_in, host_in  # in place (and broadcast)
        return host_in, stage.host("out", call.out.nbytes).view(call.out.dtype)


def label(call: Call, seq: int) -> str:
    """The call as messages name it: "allreduce #12 (1000 x float32, sum)"."""
    if call.collective == Collective.BARRIER:
        return f"barrier #{seq}"
    assert call.inp is not None
    desc = f"{call.count} x {call.inp.dtype.name}"
    if call.op is not None:
        desc += f", {call.op.name.lower()}"
    if call.collective in HAS_ROOT:
        desc += f", root {call.root}"
    elif call.root < 0:  # the wide sum of an integer avg (int_avg.marker)
        desc += f": the integer avg of {int_avg.avg_dtype(call.root)}"
    return f"{call.collective} #{seq} ({desc})"


def check_word(call: Call, kind: BoardKind | None = None, chunk_bytes: int = 0) -> int:
    """The word every message (and board sync point) of ``call`` carries, so ranks that call
    different collectives find out (``kind``: the board call's, where not the call's). A
    schedule's messages fold in its ``chunk_bytes``: ranks whose schedules cut the buffer
    differently (device buffers on one rank, host buffers on another: `schedule_chunk`) are
    told, not left to misread each other's chunks."""
    return _frontend.check_word(
        kind or BoardKind.of(call.collective),
        call.inp.check_code if call.inp is not None else 255,
        int(call.op) if call.op is not None else 255,
        call.count,
        call.root,
        chunk_bytes,
    )


def schedule_chunk(ctx: Context, call: Call) -> int:
    """The pipeline chunk of ``call``'s schedule, whichever path runs it: device buffers take
    the device chunk (staged whole or on CUDA streams, the same messages)."""
    on_device = call.inp is not None and call.inp.memory == MemoryKind.CUDA
    return (ctx.device_chunk_bytes or ctx.chunk_bytes) if on_device else ctx.chunk_bytes


_HOW = {
    hostcoll.SLOTS: "through the shared slots",
    hostcoll.DIRECT: "reading and writing the peers' buffers",
    hostcoll.SYNC_ONLY: "agreement only (the schedules run it)",
}


class PathBase:
    """A path's shared steps, and where its call in progress is: on the boards or on the links
    (whichever fails tells its own peers; `abort` tells the others)."""

    name = ""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._busy = False  # a call in progress (it stays set once one failed)
        self._on_boards = False  # ... and it is on the boards now

    def run(self, plan: Plan, call: Call, seq: int) -> None:
        self._busy, self._on_boards = True, False
        self._run(plan, call, seq)
        self._busy = False

    def _run(self, plan: Plan, call: Call, seq: int) -> None:
        raise NotImplementedError

    def failed_on_boards(self) -> None:
        """A call of this path's failed on the boards outside `run` (the compiled front end):
        `abort` then tells the links, as after a failed board step of `run`."""
        self._busy, self._on_boards = True, True

    def abort(self, code: int, reason: str) -> None:
        if not self._busy:
            return
        if self._on_boards:
            if self.ctx.links is not None:
                self.ctx.links.abort(code, reason)
        elif self.ctx.boards is not None:
            self.ctx.boards.abort(code, reason)

    def close(self) -> None:
        pass

    # --- steps ----------------------------------------------------------------------------------
    def on_boards(
        self,
        boards: HostCollectives,
        call: Call,
        seq: int,
        host_in: np.ndarray | None,
        host_out: np.ndarray | None,
        itemsize: int,
        mode: int,
        *,
        kind: BoardKind | None = None,
        divisor: int = 0,
        segment: tuple[int, int] | None = None,
        own_buffers: bool = False,
    ) -> None:
        """Run ``kind`` (default: the call's collective) of ``call`` through ``boards``; on the
        elements ``segment`` = (offset, count) of the buffers only, when given;
        ``own_buffers``: the buffers are ``host_in`` and ``host_out`` (the path's), not the
        call's."""
        self._on_boards = True
        kind = kind or BoardKind.of(call.collective)
        op = call.op
        inp = out = 0
        offset, count = segment or (0, call.count)
        if host_in is not None and host_out is not None and host_in.size:
            if call.inp is not None and call.inp.memory == MemoryKind.HOST and not own_buffers:
                inp, out = call.inp.ptr, call.out.ptr  # type: ignore[union-attr]
            else:  # device buffers staged in host memory, or the path's own buffers
                inp, out = array_address(host_in), array_address(host_out)
            inp, out = inp + offset * itemsize, out + offset * itemsize
        if self.ctx.debug:
            part = "" if kind.phase is None else f", {kind.phase}"
            log.debug(
                "rank %d: %s%s via %s, %s",
                self.ctx.rank,
                label(call, seq),
                part,
                hostcoll.NAME,
                _HOW[mode],
            )
        boards.run(
            BoardCall(
                kind,
                inp,
                out,
                count,
                itemsize,
                int(call.inp.code) if call.inp is not None else 0,
                int(Op.SUM if op is None or op == Op.AVG else op),
                check_word(call, kind),
                lambda: label(call, seq),
                mode,
                divisor,
                call.root,
                (host_in, host_out),
            )
        )

    def agree_first(
        self,
        plan: Plan,
        call: Call,
        seq: int,
        host_in: np.ndarray | None = None,
        host_out: np.ndarray | None = None,
    ) -> None:
        """Before a path over the links: compare the call with this host's other ranks at one
        sync point of the boards (where there are boards: so ranks of one host that disagree
        never take different paths)."""
        ctx = self.ctx
        if plan.mode == hostcoll.SYNC_ONLY:
            assert ctx.host is not None
            self.on_boards(
                ctx.host,
                call,
                seq,
                host_in,
                host_out,
                plan.itemsize,
                plan.mode,
                divisor=ctx.size if call.op == Op.AVG else 0,
            )
        elif ctx.node is not None:
            self.on_boards(ctx.node, call, seq, None, None, plan.itemsize, hostcoll.SYNC_ONLY)
        self._on_boards = False

    def on_links(
        self,
        call: Call,
        seq: int,
        planned: tuple[tuning.Choice, Schedule],
        host_in: np.ndarray | None,
        host_out: np.ndarray | None,
        itemsize: int,
        timeout: float | None = None,
        start: int = 0,
        pending: Any = None,
        native: bool = True,
    ) -> None:
        """Run ``planned``'s schedule of ``call`` on host memory over the links (from step
        ``start``: those before it are done, but for the send ``pending`` still going out;
        ``native`` False: the links' runner has had the steps)."""
        self._on_boards = False
        ctx = self.ctx
        name = functools.partial(label, call, seq)
        choice, sched = planned
        if ctx.debug:
            log.debug(
                "rank %d: %s via %s, box %s, %d steps, %d messages out",
                ctx.rank,
                name(),
                choice.describe(),
                ctx.topology.shape,
                len(sched.steps),
                sched.messages(),
            )
        empty = engine.Region(0, memoryview(bytearray()))
        buffers = {
            Buf.INPUT: engine.Region.of(host_in) if host_in is not None else empty,
            Buf.OUTPUT: engine.Region.of(host_out) if host_out is not None else empty,
        }
        if sched.scratch_count:
            buffers[Buf.SCRATCH] = ctx.scratch_region(sched.scratch_count * itemsize)
        coll = engine.Collective(
            seq & 0x7FFFFFFF,
            check_word(call, chunk_bytes=choice.chunk_bytes),
            itemsize,
            int(call.inp.code) if call.inp is not None else 0,
            call.op,
            name,
            lambda check, nbytes: describe_check(check, call, ctx.size, choice.chunk_bytes, nbytes),
        )
        engine.run(
            sched,
            coll,
            buffers,
            ctx.links,
            ctx.staging,
            ctx.depth,
            ctx.timeout if timeout is None else timeout,
            start,
            pending,
            native,
        )

    def in_host_memory(
        self, call: Call, run: Callable[[np.ndarray | None, np.ndarray | None], None]
    ) -> None:
        """``run(host_in, host_out)`` on host memory: the call's own buffers, or for device
        buffers pinned copies (the input downloaded first, the result uploaded after), in
        the buffers' GPU context (with the caller on the legacy default stream, no ready
        event, only that context's legacy stream orders the download after its kernels)."""
        inp = call.inp
        if inp is None or inp.memory != MemoryKind.CUDA:
            run(
                inp.array if inp is not None else None,
                call.out.array if call.out is not None else None,
            )
            return
        assert call.out is not None
        with device.on_device(inp.device):
            host_in, host_out = self.ctx.host_arrays(call)
            run(host_in, host_out)
            if call.out.memory == MemoryKind.CUDA:
                self.ctx.pinned().upload(host_out, call.out.array)
