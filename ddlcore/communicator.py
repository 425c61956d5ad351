"""The public API's `Communicator` and its collectives (`ddlcore.bootstrap.init` makes one).

Each collective validates its arguments before any communication (``calls``: bad input is a
ValueError/TypeError naming the argument) and turns buffers into descriptors (``buffers``). Then
it runs one of three ways: all ranks on this host, as one call through the shared boards
(``hostcoll``); an allreduce, reduce-scatter or allgather whose box has host and network
dimensions, as mdring with its host dimensions on the boards and the rest as schedules
(``host_staged``); or otherwise ``tuning`` picks an algorithm whose schedule the ``engine``
executes over the transports
(``device_engine`` for device buffers, chunks pipelined on CUDA streams; the board paths stage
device buffers whole). Every way compares the ranks' calls as it runs, so ranks that disagree
raise CollectiveMismatchError, all of them (``algorithms.agreement``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import struct
import threading
import zlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ddlcore import (
    calls,
    config,
    device,
    device_engine,
    engine,
    flight,
    host_staged,
    hostcoll,
    int_avg,
    topology,
    tuning,
)
from ddlcore.algorithms import ALGORITHMS, Buf, Schedule, agreement, mdring
from ddlcore.buffers import MemoryKind
from ddlcore.calls import Call
from ddlcore.errors import CollectiveMismatchError, CommunicatorClosedError
from ddlcore.handles import Executor, Handle
from ddlcore.kernels.cpu import array_address
from ddlcore.links import Links
from ddlcore.ops import Op
from ddlcore.rendezvous import RendezvousInfo
from ddlcore.transports.base import PeerInfo

log = logging.getLogger("ddlcore")

_KIND = hostcoll.KIND
_DEBUG_SEQ = 0x80000000  # tag space of DDL_DEBUG's signature exchange, apart from collectives
# Transports whose messages carry the check word (`transports.base`): over the others (MPI) the
# ranks compare their calls explicitly before each collective (`engine.agree`).
_CHECKED_TRANSPORTS = frozenset({"tcp", "shm", "ucx"})


def _make_schedule(collective: str, choice: tuning.Choice, rank: int, size: int, count: int,
                   itemsize: int, root: int, topo: topology.Topology) -> Schedule:
    make = ALGORITHMS[collective][choice.algorithm]
    if collective == "barrier":
        return make(rank, size)
    if collective == "broadcast":
        return make(rank, size, count, itemsize, choice.chunk_bytes, root)
    if choice.segments > 1:
        return make(rank, size, count, itemsize, choice.chunk_bytes, topo,
                    dim_order=choice.dim_order, segments=choice.segments)
    if choice.dim_order is not None:
        return make(rank, size, count, itemsize, choice.chunk_bytes, topo, dim_order=choice.dim_order)
    return make(rank, size, count, itemsize, choice.chunk_bytes, topo)


class Communicator:
    """A group of ranks that run collectives together. Create it with `ddlcore.init`.

    Attributes
    ----------
    rank, size : int
        This process's rank and the number of ranks.
    local_rank, local_size : int
        Rank among, and number of, the ranks on this host.
    """

    def __init__(self, info: RendezvousInfo, peers: list[PeerInfo], store: Any, links: Links | None,
                 timeout: float, environ: Mapping[str, str] | None = None,
                 algo: str | None = None, topo: topology.Topology | None = None,
                 host: hostcoll.HostCollectives | None = None,
                 node: hostcoll.HostCollectives | None = None) -> None:
        self.rank, self.size = info.rank, info.size
        self._layout = topology.layout([p.host_id for p in peers], self.rank)
        self.topology = topo or topology.flat(self.size, level="host")
        self.local_rank, self.local_size = self._layout.local_rank, self._layout.local_size
        self.peers = peers
        self.source = info.source
        self.timeout = timeout
        self._store = store
        self._links = links
        self._host = host    # every rank on this host: all collectives through the boards
        self._node = node    # this host's ranks, when there are others: mdring's host dimensions
        self._algo = algo.lower() if algo else config.get("DDL_ALGO", environ)
        tuning.validate_algo(self._algo)
        self._chunk_bytes = max(1, config.get("DDL_CHUNK_BYTES", environ))
        self._segments = config.get("DDL_SEGMENTS", environ)
        # Schedules are pure functions of the call's shape on a fixed topology: keep the recent.
        self._schedule = functools.lru_cache(maxsize=256)(self._build_schedule)
        self._staged = functools.lru_cache(maxsize=256)(self._host_stage)
        self._schedule_across = functools.lru_cache(maxsize=256)(self._build_across)
        self._on_boards = False  # where the call in progress is (whom to tell if it fails)
        self._depth = config.get("DDL_PIPELINE_DEPTH", environ)
        self._debug = config.get("DDL_DEBUG", environ)
        self._staging = engine.StagingPool()
        self._staging_device: Any = None
        self._slots_device: dict[int, device_engine.DeviceSlots] = {}
        self._scratch = np.empty(0, np.uint8)
        # host_staged's buffers by name, kept (and grown, never shrunk) for the communicator's
        # life: the network rings' part (H/P of a call) and, for irregular placements, a copy
        self._stage: dict[str, np.ndarray] = {}
        self._executor = Executor(f"ddlcore-rank{self.rank}")
        self._before_collective: list[Callable[[], Any]] = []
        self._in_hooks = threading.local()
        self._broken: str | None = None
        # Some link cannot judge check words: compare the calls explicitly (`engine.agree`).
        self._agree_explicitly = links is not None and any(
            name not in _CHECKED_TRANSPORTS for name in links.choice.values())
        self._closed = False
        self._close_lock = threading.Lock()
        # Each call runs through the flight recorder (its last collectives, written out when one
        # fails: ddlcore.flight); with DDL_FLIGHT_RECORDER_ENTRIES=0 this is _execute itself.
        self._flight = flight.FlightRecorder.for_communicator(
            self, f"{info.master_addr or 'local'}:{info.master_port or 0}", environ)
        self._execute_recorded = self._flight.recording(self._execute)

    # --- introspection -------------------------------------------------------------------------
    @property
    def transports(self) -> dict[int, str]:
        """The transport carrying each peer pair, by peer rank."""
        return dict(self._links.choice) if self._links else {}

    @property
    def nhosts(self) -> int:
        return self._layout.nhosts

    def describe(self, collective: str, nbytes: int) -> tuning.Choice:
        """The algorithm, box-dimension order and chunking this communicator would use for a
        collective of ``nbytes`` of input (the cost model's choice under ``DDL_ALGO=auto``, or
        the host collectives when every rank is on this host)."""
        mode = self._host.mode(nbytes) if self._host is not None else hostcoll.SYNC_ONLY
        if mode != hostcoll.SYNC_ONLY:
            return tuning.Choice(hostcoll.NAME,
                                 hostcoll.CHUNK_BYTES if mode == hostcoll.DIRECT else nbytes)
        staged = self._staged(collective, nbytes)
        return staged if staged is not None else self._choose(collective, nbytes)

    def _choose(self, collective: str, nbytes: int) -> tuning.Choice:
        """The tuner's choice for ``nbytes`` of input (the cost model reads an allgather's
        output)."""
        boards = self._node is not None and collective in host_staged.COLLECTIVES and \
            self._node.mode(host_staged.board_bytes(collective, nbytes, self.topology)) != \
            hostcoll.SYNC_ONLY
        return tuning.choose(collective, self.topology,
                             tuning.model_bytes(collective, nbytes, self.size), self._algo,
                             self._chunk_bytes, boards, self._segments)

    def _host_stage(self, collective: str, nbytes: int) -> tuning.Choice | None:
        """The choice when a collective of ``nbytes`` of input runs as mdring with its host
        dimensions through this host's boards (``host_staged``); None when it runs as a
        schedule (also where its board calls would be too large for the slots and direct reads
        are off)."""
        if self._node is None or collective not in host_staged.COLLECTIVES:
            return None
        mode = self._node.mode(host_staged.board_bytes(collective, nbytes, self.topology))
        choice = self._choose(collective, nbytes)
        if mode == hostcoll.SYNC_ONLY or choice.algorithm != mdring.NAME or \
                not tuning.host_first(self.topology, choice.dim_order):
            return None
        return dataclasses.replace(choice, host_path=hostcoll.NAME)

    def _build_schedule(self, collective: str, count: int, itemsize: int, root: int) -> tuple[tuning.Choice, Schedule]:
        choice = self._choose(collective, count * itemsize)
        return choice, agreement.agreed(
            lambda r: _make_schedule(collective, choice, r, self.size, count, itemsize, root,
                                     self.topology),
            self.rank, self.size, agreement.natural_completeness(collective, count))

    def _build_across(self, collective: str, count: int, itemsize: int, choice: tuning.Choice,
                      first: bool = True, call_count: int = 1) -> tuple[tuning.Choice, Schedule]:
        """The host-staged rings across hosts on ``count`` elements; ``first``: the call's
        first network phase (it makes first contact, see `agreement`); ``call_count``: the
        call's element count (an empty call adds the agreement's rounds)."""
        make = {"allreduce": mdring.allreduce_across_hosts,
                "reduce_scatter": mdring.reduce_scatter_across_hosts,
                "allgather": mdring.allgather_across_hosts}[collective]
        return choice, agreement.agreed(
            lambda r: make(r, self.size, count, itemsize, choice.chunk_bytes, self.topology,
                           choice.dim_order),
            self.rank, self.size, call_count > 0, first)

    def __repr__(self) -> str:
        return (f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
                f"local_size={self.local_size}, hosts={self.nhosts}, box={self.topology.shape})")

    # --- execution ------------------------------------------------------------------------------
    def _label(self, call: Call, seq: int) -> str:
        if call.collective == "barrier":
            return f"barrier #{seq}"
        assert call.inp is not None
        desc = f"{call.count} x {call.inp.dtype.name}"
        if call.op is not None:
            desc += f", {call.op.name.lower()}"
        if call.collective == "broadcast":
            desc += f", root {call.root}"
        elif call.root < 0:  # the wide sum of an integer avg (int_avg.marker)
            desc += f": the integer avg of {int_avg.avg_dtype(call.root)}"
        return f"{call.collective} #{seq} ({desc})"

    def _check_word(self, call: Call, kind: str | None = None) -> int:
        code = int(call.inp.code) if call.inp is not None else 255
        op = int(call.op) if call.op is not None else 255
        raw = struct.pack("<BBBqq", _KIND[kind or call.collective], code, op, call.count,
                          call.root)
        return zlib.crc32(raw) | 1

    def _agree(self, call: Call, seq: int) -> None:
        """Over links without check words: compare this call with every rank's (`engine.agree`)
        before it runs."""
        engine.agree(self.rank, self.size, seq & 0x7FFFFFFF, self._check_word(call),
                     calls.fingerprint(call), self._links, self.timeout,
                     self._label(call, seq), calls.describe_fingerprint)

    def _sync_node(self, call: Call, seq: int, itemsize: int) -> None:
        """Compare the call with this host's other ranks at one sync point of the boards
        before a network phase starts (every path over several hosts begins with one, so
        ranks of one host that disagree never take different paths)."""
        assert self._node is not None
        self._run_boards(self._node, call.collective, call, seq, None, None, itemsize,
                         hostcoll.SYNC_ONLY, 0)
        self._on_boards = False

    def _scratch_region(self, nbytes: int) -> engine.Region:
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(nbytes, np.uint8)
        return engine.Region.of(self._scratch[:nbytes])

    def _stage_buffer(self, name: str, nbytes: int) -> np.ndarray:
        """``nbytes`` of host memory kept for the host-staged paths (``name`` tells apart the
        buffers one call uses at once)."""
        buf = self._stage.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = self._stage[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def _execute(self, call: Call, seq: int) -> Any:
        if self._broken is not None:
            raise CommunicatorClosedError(
                f"rank {self.rank}: {call.collective} refused: this communicator failed earlier "
                f"({self._broken}); create a new one with ddlcore.init()")
        if int_avg.applies(call, self.size):  # a "sum" of a wider buffer, then a division
            return self._integer_avg(call, seq)
        itemsize = call.inp.dtype.itemsize if call.inp is not None else 1
        boards = self._host or self._node
        self._on_boards = False
        try:
            if self._debug and self.size > 1:
                self._check_agreement(call, seq, self._label(call, seq))
            if self._agree_explicitly and self._host is None:
                self._agree(call, seq)
            nbytes = call.count * itemsize
            mode = self._host.mode(nbytes) if self._host is not None else None
            staged = self._staged(call.collective, nbytes) if self._node is not None else None
            on_boards = (mode is not None and mode != hostcoll.SYNC_ONLY) or staged is not None
            if call.inp is not None and call.inp.memory == MemoryKind.CUDA and not on_boards:
                if mode == hostcoll.SYNC_ONLY:  # compare the calls on the boards first
                    self._run_on_host(call, seq, None, None, itemsize, mode)
                elif self._node is not None:
                    self._sync_node(call, seq, itemsize)
                self._on_boards = False
                self._run_device(call, seq, itemsize)
                return call.result
            if call.inp is not None and call.inp.memory == MemoryKind.CUDA:
                # Staged through host memory in the buffers' GPU context: with the caller on
                # the legacy default stream (no ready event), only that context's legacy
                # stream orders the download after the caller's kernels.
                with device.on_device(call.inp.device):
                    self._run_in_host_memory(call, seq, itemsize, mode, staged)
            else:
                self._run_in_host_memory(call, seq, itemsize, mode, staged)
        except BaseException as exc:  # a DDLError, or Ctrl-C (or a bug) half-way through a call
            self._broken = str(exc) or type(exc).__name__
            from ddlcore.launcher import record_failure  # for ddlrun: who failed first
            record_failure(self.rank, exc)
            # Whichever path failed has told its own peers; tell the other path's too, so that
            # nobody waits out its deadline there (the reason without our "rank R: " prefix).
            reason = engine.failure_reason(exc)
            if self._on_boards and self._links is not None:
                self._links.abort(engine.abort_code(exc), reason)
            elif not self._on_boards and boards is not None:
                boards.abort(engine.abort_code(exc), reason)
            raise
        return call.result

    def _integer_avg(self, call: Call, seq: int) -> Any:
        """An integer avg, exact (``int_avg``): device buffers through host memory."""
        assert call.inp is not None and call.out is not None
        if call.inp.memory != MemoryKind.CUDA:
            int_avg.run(call, self.size, None, lambda wide: self._execute(wide, seq))
            return call.result
        with device.on_device(call.inp.device):
            host = self._host_arrays(call)
            int_avg.run(call, self.size, host, lambda wide: self._execute(wide, seq))
            self._device_staging().upload(host[1], call.out.array)
        return call.result

    def _run_in_host_memory(self, call: Call, seq: int, itemsize: int, mode: int | None,
                            staged: tuning.Choice | None) -> None:
        """Run the call on host memory: the boards, the host-staged mdring or a schedule (device
        buffers are downloaded first and the result uploaded after)."""
        inp = call.inp
        host_in: np.ndarray | None
        host_out: np.ndarray | None
        if inp is not None and inp.memory == MemoryKind.CUDA:
            host_in, host_out = self._host_arrays(call)
        else:  # host buffers as they are (checked here: a call less on the fast path)
            host_in = inp.array if inp is not None else None
            host_out = call.out.array if call.out is not None else None
        if mode is not None and mode != hostcoll.SYNC_ONLY:
            self._run_on_host(call, seq, host_in, host_out, itemsize, mode)
        elif staged is not None:
            assert host_out is not None
            host_staged.RUN[call.collective](self, call, seq, host_in, host_out, itemsize,
                                             staged)
        else:
            if mode == hostcoll.SYNC_ONLY:  # compare the calls on the boards first
                self._run_on_host(call, seq, host_in, host_out, itemsize, mode)
            elif self._node is not None:
                self._sync_node(call, seq, itemsize)
            self._on_boards = False
            self._run_schedule(call, seq, host_in, host_out, itemsize)
        if call.out is not None and call.out.memory == MemoryKind.CUDA:
            self._device_staging().upload(host_out, call.out.array)

    def _run_on_host(self, call: Call, seq: int, host_in: np.ndarray | None,
                     host_out: np.ndarray | None, itemsize: int, mode: int) -> None:
        assert self._host is not None
        op = call.op
        self._run_boards(self._host, call.collective, call, seq, host_in, host_out, itemsize,
                         mode, self.size if op == Op.AVG else 0)

    def _run_boards(self, boards: hostcoll.HostCollectives, kind: str, call: Call, seq: int,
                    host_in: np.ndarray | None, host_out: np.ndarray | None, itemsize: int,
                    mode: int, divisor: int, segment: tuple[int, int] | None = None,
                    own_buffers: bool = False) -> None:
        """Run ``kind`` (a `hostcoll.KIND`) of ``call`` through ``boards``; on the elements
        ``segment`` = (offset, count) of the buffers only, when given; ``own_buffers``: the
        buffers are ``host_in`` and ``host_out`` (``host_staged``'s), not the call's."""
        self._on_boards = True
        op = call.op
        inp = out = 0
        offset, count = segment or (0, call.count)
        if host_in is not None and host_out is not None and host_in.size:
            if call.inp is not None and call.inp.memory == MemoryKind.HOST and not own_buffers:
                inp, out = call.inp.ptr, call.out.ptr  # type: ignore[union-attr]
            else:  # device buffers staged in host memory, or host_staged's own buffers
                inp, out = array_address(host_in), array_address(host_out)
            inp, out = inp + offset * itemsize, out + offset * itemsize
        if self._debug:
            how = {hostcoll.SLOTS: "through the shared slots",
                   hostcoll.DIRECT: "reading and writing the peers' buffers",
                   hostcoll.SYNC_ONLY: "agreement only (the schedules run it)"}[mode]
            part = "" if kind == call.collective else f", {kind.split(', ', 1)[1]}"
            log.debug("rank %d: %s%s via %s, %s", self.rank, self._label(call, seq), part,
                      hostcoll.NAME, how)
        boards.run(_KIND[kind], inp, out, count, itemsize,
                   int(call.inp.code) if call.inp is not None else 0,
                   int(Op.SUM if op is None or op == Op.AVG else op), divisor, call.root,
                   self._check_word(call, kind), lambda: self._label(call, seq), mode,
                   (host_in, host_out))

    def _run_schedule(self, call: Call, seq: int, host_in: np.ndarray | None,
                      host_out: np.ndarray | None, itemsize: int,
                      planned: tuple[tuning.Choice, Schedule] | None = None,
                      timeout: float | None = None) -> None:
        label = self._label(call, seq)
        choice, sched = planned or self._schedule(call.collective, call.count, itemsize,
                                                  call.root)
        if self._debug:
            log.debug("rank %d: %s via %s, box %s, %d steps, %d messages out", self.rank, label,
                      choice.describe(), self.topology.shape, len(sched.steps),
                      sched.messages())
        empty = engine.Region(0, memoryview(bytearray()))
        buffers = {
            Buf.INPUT: engine.Region.of(host_in) if host_in is not None else empty,
            Buf.OUTPUT: engine.Region.of(host_out) if host_out is not None else empty,
        }
        if sched.scratch_count:
            buffers[Buf.SCRATCH] = self._scratch_region(sched.scratch_count * itemsize)
        coll = engine.Collective(seq & 0x7FFFFFFF, self._check_word(call), itemsize,
                                 int(call.inp.code) if call.inp is not None else 0,
                                 call.op, label)
        engine.run(sched, coll, buffers, self._links, self._staging, self._depth,
                   self.timeout if timeout is None else timeout)

    def _run_device(self, call: Call, seq: int, itemsize: int) -> None:
        """Run the call's schedule on its device buffers, chunks pipelined on CUDA streams."""
        assert call.inp is not None and call.out is not None
        label = self._label(call, seq)
        choice, sched = self._schedule(call.collective, call.count, itemsize, call.root)
        if self._debug:
            peers = sorted({st.peer for st in sched.steps if st.peer >= 0})
            direct = [p for p in peers if self._links is not None and
                      getattr(self._links.pair(p), "device_memory", False)]
            how = ("device memory straight to and from " + ", ".join(f"rank {p}" for p in direct)
                   if direct else "through pinned host slots")
            if direct and len(direct) < len(peers):
                how += ", the others through pinned host slots"
            log.debug("rank %d: %s via %s on CUDA streams (%s), box %s, %d steps, %d messages "
                      "out", self.rank, label, choice.describe(), how, self.topology.shape,
                      len(sched.steps), sched.messages())
        # The executor's thread has no current CUDA context: streams, slots and kernels must be
        # on the buffers' GPU, not on whichever Numba would make current (GPU 0).
        with device.on_device(call.inp.device):
            slots = self._device_slots(call.inp.device)
            buffers = {Buf.INPUT: device.region_of(call.inp.array),
                       Buf.OUTPUT: device.region_of(call.out.array)}
            if sched.scratch_count:
                buffers[Buf.SCRATCH] = slots.scratch(sched.scratch_count * itemsize)
            coll = engine.Collective(seq & 0x7FFFFFFF, self._check_word(call), itemsize,
                                     int(call.inp.code), call.op, label)
            device_engine.run(sched, coll, buffers, self._links, slots, self._depth,
                              self.timeout, call.ready)

    def _device_slots(self, device_id: int) -> device_engine.DeviceSlots:
        """Streams and staging slots of GPU ``device_id`` (made in its context)."""
        slots = self._slots_device.get(device_id)
        if slots is None:
            slots = self._slots_device[device_id] = device_engine.DeviceSlots(
                device_engine.NumbaStreams())
        return slots

    def _device_staging(self) -> Any:
        if self._staging_device is None:
            self._staging_device = device.DeviceStaging()
        return self._staging_device

    def _host_arrays(self, call: Call) -> tuple[np.ndarray, np.ndarray]:
        """The host memory the boards or the engine work on for device buffers: pinned copies
        (the input downloaded now; the output uploaded after the call ran)."""
        assert call.inp is not None and call.out is not None
        stage = self._device_staging()
        if call.ready is not None:
            call.ready.synchronize()
        host_in = stage.download(call.inp.array, "in", call.inp.dtype, call.inp.count)
        if call.out.ptr == call.inp.ptr and call.out.count == call.inp.count:
            return host_in, host_in  # in place (and broadcast)
        return host_in, stage.host("out", call.out.nbytes).view(call.out.dtype)

    def _check_agreement(self, call: Call, seq: int, label: str) -> None:
        """DDL_DEBUG: allgather every rank's (kind, dtype, op, count, root) and compare."""
        mine = np.array([_KIND[call.collective], int(call.inp.code) if call.inp else -1,
                         int(call.op) if call.op is not None else -1, call.count, call.root],
                        np.int64)
        every = np.empty(self.size * mine.size, np.int64)
        sched = ALGORITHMS["allgather"]["ring"](self.rank, self.size, mine.size, 8, 1 << 20)
        coll = engine.Collective((seq & 0x7FFFFFFF) | _DEBUG_SEQ, 0, 8, 7, None,
                                 f"{label} agreement check")
        engine.run(sched, coll, {Buf.INPUT: engine.Region.of(mine),
                                 Buf.OUTPUT: engine.Region.of(every)},
                   self._links, self._staging, self._depth, self.timeout)
        rows = every.reshape(self.size, mine.size)
        if not (rows == mine).all():
            names = {v: k for k, v in _KIND.items()}
            lines = [f"rank {r}: {names.get(int(k), '?')} count={c} dtype_code={d} op_code={o} "
                     f"root={root}" for r, (k, d, o, c, root) in enumerate(rows.tolist())]
            raise CollectiveMismatchError(
                f"rank {self.rank}: {label}: ranks called different collectives "
                f"(DDL_DEBUG check):\n  " + "\n  ".join(lines))

    def add_before_collective(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """Call ``fn()`` on the calling thread before each collective this communicator starts
        (synchronous or async), so that work a layer above has deferred goes first, in the same
        order on every rank. Collectives ``fn`` itself starts do not call the hooks again.
        Returns a function that removes the hook.

        The PyTorch `DistributedOptimizer` uses it to send the gradient buckets backward has not
        completed before a collective the training loop issues between backward and ``step()``.
        """
        self._before_collective.append(fn)
        return lambda: self._before_collective.remove(fn)

    def _run_hooks(self) -> None:
        if not self._before_collective or getattr(self._in_hooks, "active", False):
            return
        self._in_hooks.active = True
        try:
            for fn in list(self._before_collective):
                fn()
        finally:
            self._in_hooks.active = False

    def _run(self, call: Call) -> Any:
        if self._before_collective:
            self._run_hooks()
        return self._executor.run_inline(
            functools.partial(self._execute_recorded, call),
            lambda: Handle(f"rank {self.rank}: {call.collective}", self._wait_budget()))

    def _submit(self, call: Call) -> Handle:
        if self._before_collective:
            self._run_hooks()
        handle = Handle(f"rank {self.rank}: {call.collective}", self._wait_budget())
        return self._executor.submit(functools.partial(self._execute_recorded, call), handle)

    def flight_record(self) -> dict[str, Any]:
        """This rank's flight record, now (what ``DDL_FLIGHT_RECORDER`` files hold).

        Returns
        -------
        dict
            Plain JSON data: rank, size, host, pid, the error that broke the communicator (or
            None), and under "entries" the last ``DDL_FLIGHT_RECORDER_ENTRIES`` collectives,
            oldest first: seq, collective, count, bytes, dtype, op, root, algorithm, path
            (boards, host-staged, schedule or device), start and end (Unix time) and state
            (started, completed or failed). ``json.dump`` it into a directory with the other
            ranks' and ``python -m ddlcore.trace DIR`` reads it.
        """
        return self._flight.document("request")

    def _wait_budget(self) -> float:
        # Each queued collective is bounded by DDL_TIMEOUT, so this bounds a handle's wait.
        return self.timeout * (self._executor.pending() + 1) + 5.0

    # --- collectives ----------------------------------------------------------------------------
    def allreduce(self, x: Any, op: str | Op = "sum", out: Any = None) -> Any:
        """Reduce ``x`` element-wise over all ranks; every rank gets the same result.

        Parameters
        ----------
        x : array
            Contiguous NumPy array (float16, bfloat16, float32, float64, int8, uint8, int32,
            int64), or any buffer-protocol / host DLPack object of those types.
        op : {"sum", "avg", "prod", "min", "max"} or Op
        out : array, optional
            Destination with x's dtype and element count; may be ``x`` itself (in place).

        Returns
        -------
        array
            ``out`` if given, else a new array shaped like ``x`` (same kind as ``x``).

        Raises
        ------
        TypeError, ValueError
            Bad arguments, before any communication.
        DDLError
            A peer failed, ranks disagree, or ``DDL_TIMEOUT`` passed.
        """
        return self._run(calls.prepare("allreduce", x, op, out, 0, self.size))

    def allreduce_async(self, x: Any, op: str | Op = "sum", out: Any = None) -> Handle:
        """`allreduce` in the background; returns a `Handle` (``wait()`` gives the result).
        ``x`` and ``out`` must not be touched until the handle completes."""
        return self._submit(calls.prepare("allreduce", x, op, out, 0, self.size))

    def reduce_scatter(self, x: Any, op: str | Op = "sum", out: Any = None) -> Any:
        """Reduce ``x`` (size * k elements) over all ranks; rank r gets block r (k elements).

        A multi-dimensional ``x`` whose first dimension divides by size is split along it
        (output shape ``(shape[0] // size, *shape[1:])``); otherwise the output is 1-D.
        Raises ValueError when x's element count is not divisible by size.
        """
        return self._run(calls.prepare("reduce_scatter", x, op, out, 0, self.size))

    def reduce_scatter_async(self, x: Any, op: str | Op = "sum", out: Any = None) -> Handle:
        return self._submit(calls.prepare("reduce_scatter", x, op, out, 0, self.size))

    def allgather(self, x: Any, out: Any = None) -> Any:
        """Concatenate every rank's ``x`` (k elements each) along the first dimension, in rank
        order: the result has size * k elements."""
        return self._run(calls.prepare("allgather", x, None, out, 0, self.size))

    def allgather_async(self, x: Any, out: Any = None) -> Handle:
        return self._submit(calls.prepare("allgather", x, None, out, 0, self.size))

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Copy root's ``x`` into ``x`` on every rank (in place); returns ``x``."""
        return self._run(calls.prepare("broadcast", x, None, None, root, self.size))

    def broadcast_async(self, x: Any, root: int = 0) -> Handle:
        return self._submit(calls.prepare("broadcast", x, None, None, root, self.size))

    def barrier(self) -> None:
        """Return only after every rank has entered the barrier."""
        self._run(calls.prepare("barrier", None, None, None, 0, self.size))

    # --- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Finish queued collectives (within DDL_TIMEOUT), then release connections and threads.

        Rank 0 keeps serving the rendezvous store until its process exits, so ranks that close
        later, or call ``init()`` again, can still reach it.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._broken is None:
                self._executor.drain(self.timeout)
        finally:
            self._flight.closed()
            self._executor.close(5.0)
            for boards in (self._host, self._node):
                if boards is not None:
                    boards.close()
            if self._links is not None:
                self._links.close()
            if self._store is not None:
                self._store.close()

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
