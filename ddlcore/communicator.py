"""The public API's `Communicator` and its collectives (`ddlcore.bootstrap.init` makes one).

Each collective validates its arguments before any communication (``calls``: bad input is a
ValueError/TypeError naming the argument) and turns buffers into descriptors (``buffers``). Then
the first execution path that accepts the call runs it on the communicator's executor thread
(``ddlcore.execution.paths``): all ranks on this host, as one call through the shared boards; mdring
across hosts with its host dimensions on the boards; device buffers as a schedule on CUDA
streams; or otherwise the tuner's algorithm as a schedule over the transports. Every path
compares the ranks' calls as it runs, so ranks that disagree raise CollectiveMismatchError, all
of them (``algorithms.agreement``). The communicator keeps what is not a path's: sequence
numbers, the agreement checks, hooks, the executor and the failure that broke it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ddlcore import calls, config, device, flight, membership, p2p, topology
from ddlcore.buffers import MemoryKind
from ddlcore.calls import Call
from ddlcore.collectives import Collective
from ddlcore.errors import CommunicatorClosedError, CommunicatorRevokedError, DDLError, rewrap
from ddlcore.execution import (
    checks,
    device_engine,
    engine,
    frontend,
    hostcoll,
    int_avg,
    paths,
)
from ddlcore.handles import Executor, Handle
from ddlcore.job.failure_report import record_failure
from ddlcore.job.links import Links
from ddlcore.job.rendezvous import RendezvousInfo
from ddlcore.membership import Joiner
from ddlcore.ops import Op
from ddlcore.planning import tuning
from ddlcore.resilience.channel import AgreeChannel
from ddlcore.resilience.control import ControlPlane
from ddlcore.rooted import RootedCollectives
from ddlcore.split import split_communicator
from ddlcore.transports.base import ABORT_REVOKED, PeerInfo
from ddlcore.transports.common import abort_code

# Transports whose messages carry the check word (`transports.base`): over the others (MPI) the
# ranks compare their calls explicitly before each collective (`engine.agree`).
_log = logging.getLogger("ddlcore")
_CHECKED_TRANSPORTS = frozenset({"tcp", "shm", "ucx"})
# At close, rank 0 (whose process serves the store) waits at most this long for the other ranks
# to close: one still finishing its last collective may look a peer up in the store.
_CLOSE_LINGER_S = 5.0


class Communicator(RootedCollectives):
    """A group of ranks that run collectives together. Create it with `ddlcore.init`.

    Attributes
    ----------
    rank, size : int
        This process's rank and the number of ranks.
    local_rank, local_size : int
        Rank among, and number of, the ranks on this host.
    """

    def __init__(
        self,
        info: RendezvousInfo,
        peers: list[PeerInfo],
        store: Any,
        links: Links | None,
        timeout: float,
        environ: Mapping[str, str] | None = None,
        algo: str | None = None,
        topo: topology.Topology | None = None,
        host: hostcoll.HostCollectives | None = None,
        node: hostcoll.HostCollectives | None = None,
        joiner: Joiner | None = None,
        prefixed: Any = None,
        on_close: Callable[[], None] | None = None,
        agreement: AgreeChannel | None = None,
        shrinking: membership.Shrinking | None = None,
        plane: ControlPlane | None = None,
    ) -> None:
        self.rank, self.size = info.rank, info.size
        self._layout = topology.layout([p.host_id for p in peers], self.rank)
        self.topology = topo or topology.flat(self.size, level="host")
        self.local_rank, self.local_size = self._layout.local_rank, self._layout.local_size
        self.peers = peers
        self.source = info.source
        self.timeout = timeout
        self._store = store
        self._links = links
        self._host = host  # every rank on this host: all collectives through the boards
        self._node = node  # this host's ranks, when there are others: mdring's host dimensions
        self._algo = algo.lower() if algo else config.get("DDL_ALGO", environ)
        tuning.validate_algo(self._algo)
        self._debug = config.get("DDL_DEBUG", environ)
        self._ctx = paths.Context(
            self.rank,
            self.size,
            self.topology,
            links,
            timeout,
            depth=config.get("DDL_PIPELINE_DEPTH", environ),
            debug=self._debug,
            algo=self._algo,
            chunk_bytes=max(1, config.get("DDL_CHUNK_BYTES", environ)),
            device_chunk_bytes=0
            if config.is_set("DDL_CHUNK_BYTES", environ)
            else device_engine.CHUNK_BYTES,
            segments=config.get("DDL_SEGMENTS", environ),
            host=host,
            node=node,
        )
        self._boards_path = paths.BoardsPath(self._ctx)
        self._staged_path = paths.HostStagedPath(self._ctx)
        self._device_path = paths.DevicePath(self._ctx)
        self._schedule_path = paths.SchedulePath(self._ctx)
        # In the order they are asked (`ddlcore.execution.paths.PATHS`): the first that accepts runs it.
        self._paths: tuple[paths.Path, ...] = (
            self._boards_path,
            self._staged_path,
            self._device_path,
            self._schedule_path,
        )
        self._executor = Executor(f"ddlcore-rank{self.rank}")
        self._before_collective: list[Callable[[], Any]] = []
        self._in_hooks = threading.local()
        self._broken: str | None = None
        self._failure: BaseException | None = None  # the first failure (or revoke)
        self._failed_outside = False  # it came from outside a call: `_fail_outside`
        self._revoke_lock = threading.Lock()
        # Some link cannot judge check words: compare the calls explicitly (`engine.agree`).
        self._agree_explicitly = links is not None and any(
            name not in _CHECKED_TRANSPORTS for name in links.choice.values()
        )
        self._closed = False
        self._close_lock = threading.Lock()
        # Each call runs through the flight recorder (its last collectives, written out when one
        # fails: ddlcore.flight); with DDL_FLIGHT_RECORDER_ENTRIES=0 this is _execute itself.
        self._flight = flight.FlightRecorder.for_communicator(
            self, f"{info.master_addr or 'local'}:{info.master_port or 0}", environ
        )
        self._execute_recorded = self._flight.recording(self._execute)
        # Calls a one-host communicator's boards take, in one native step (``frontend``);
        # with DDL_DEBUG every call is compared in Python first.
        self._front = (
            None
            if self._debug
            else frontend.build(
                host,
                self._executor,
                self._flight,
                self._front_end_failed,
                self._front_end_broken,
                frontend.OnLinks(
                    self.size, self._paths, self._schedule_path, self._front_end_links_failed
                )
                if host is None and not self._agree_explicitly
                else None,
            )
        )
        self._front_lock = threading.Lock()
        # send/recv (`ddlcore.p2p`) and split (`ddlcore.split`); ``prefixed``: this communicator's
        # namespace in the store, where closes are counted.
        self._p2p = p2p.PointToPoint(
            self.rank,
            self.size,
            self._pair,
            timeout,
            self._links.explain if self._links is not None else None,
        )
        self._flight.p2p_history = self._p2p.history
        self._joiner, self._prefixed, self._splits = joiner, prefixed, 0
        # What init set up for this communicator beyond it (the world's CPU pinning).
        self._on_close = on_close
        # `agree` over the process's control plane (closed with its last communicator).
        self._agreement, self._plane = agreement, plane
        # Membership: the epoch grows with each shrink; member ids stay (the world's ranks).
        self._epoch = 0
        self._member_ids: tuple[int, ...] = tuple(range(self.size))
        self._shrinking = shrinking
        # A member silent for the heartbeat timeout, or this rank fenced, fails it at once.
        self._unwatch = (
            membership.watch(plane, agreement.addresses, self.rank, self._fail_outside)
            if plane is not None and agreement is not None
            else None
        )

    # --- introspection -------------------------------------------------------------------------
    @property
    def transports(self) -> dict[int, str]:
        """The transport carrying each peer pair, by peer rank."""
        return dict(self._links.choice) if self._links else {}

    @property
    def nhosts(self) -> int:
        return self._layout.nhosts

    def describe(self, collective: str, nbytes: int, memory: str = "host") -> tuning.Choice:
        """The algorithm, box-dimension order and chunking this communicator would use for a
        collective of ``nbytes`` of input in ``memory`` ("host" or "cuda": device schedules
        take larger chunks): the cost model's choice under ``DDL_ALGO=auto``, or the host
        collectives when every rank is on this host."""
        collective = Collective(collective)
        mode = self._host.mode(nbytes) if self._host is not None else hostcoll.SYNC_ONLY
        if mode != hostcoll.SYNC_ONLY and collective in paths.ON_BOARDS:
            return tuning.Choice(
                hostcoll.NAME, hostcoll.CHUNK_BYTES if mode == hostcoll.DIRECT else nbytes
            )
        staged = self._staged_path.choice(collective, nbytes)
        if staged is not None:
            return staged
        device_chunk = self._ctx.device_chunk_bytes if memory == "cuda" else 0
        return self._ctx.choose(collective, nbytes, device_chunk or None)

    def __repr__(self) -> str:
        return (
            f"Communicator(rank={self.rank}, size={self.size}, local_rank={self.local_rank}, "
            f"local_size={self.local_size}, hosts={self.nhosts}, box={self.topology.shape})"
        )

    # --- execution ------------------------------------------------------------------------------
    def _execute(self, call: Call, seq: int) -> Any:
        if self._broken is not None:
            raise self._refusal(call.collective)
        if int_avg.applies(call, self.size):  # a "sum" of a wider buffer, then a division
            if call.collective == Collective.REDUCE:
                self._integer_avg(calls.as_allreduce(call), seq)
                return call.result
            return self._integer_avg(call, seq)
        running: paths.Path | None = None
        try:
            if self._debug and self.size > 1:
                checks.compare_calls(
                    call, seq, self.rank, self.size, self._links, self._ctx, self.timeout
                )
            if self._agree_explicitly and self._host is None:
                checks.agree(call, seq, self.rank, self.size, self._links, self.timeout)
            for path in self._paths:
                plan = path.plan(call)
                if plan is not None:
                    running = path
                    path.run(plan, call, seq)
                    break
        except BaseException as exc:  # a DDLError, or Ctrl-C (or a bug) half-way through a call
            self._fail(exc, running)
            revoked = self._revoked_instead(exc)
            if revoked is not None:
                raise revoked from exc
            raise
        return call.result

    def _revoked_instead(self, exc: BaseException) -> DDLError | None:
        """A call that failed after this communicator failed from outside it (a revoke, a
        silent member, this rank fenced) fails for that reason, whatever it saw first (a peer
        that closed on hearing of it): that error, or None where ``exc`` is of its kind
        already or the call's own failure came first."""
        first = self._failure
        if not self._failed_outside or not isinstance(first, DDLError) or first is exc:
            return None
        if isinstance(exc, type(first)) or not isinstance(exc, DDLError):
            return None
        if isinstance(first, CommunicatorRevokedError):
            return CommunicatorRevokedError(
                f"rank {self.rank}: rank {first.peer} revoked the communicator during the call "
                f"(the call then saw: {exc})",
                first.peer,
            )
        return rewrap(first, f"{first} (the call in progress then saw: {exc})")

    def _refusal(self, what: str) -> CommunicatorClosedError:
        """The error a call of a broken communicator raises: a `CommunicatorRevokedError`
        where the communicator was revoked (here or by a peer), so that the handler of the
        first failure catches every later one too."""
        if isinstance(self._failure, CommunicatorRevokedError):
            return CommunicatorRevokedError(
                f"rank {self.rank}: {what} refused: rank {self._failure.peer} revoked this "
                "communicator; create a new one with ddlcore.init()",
                self._failure.peer,
            )
        return CommunicatorClosedError(
            f"rank {self.rank}: {what} refused: this communicator failed earlier "
            f"({self._broken}); create a new one with ddlcore.init()"
        )

    def _fail(self, exc: BaseException, running: paths.Path | None) -> None:
        """The communicator is broken: record it, and tell every path, which tells the peers of
        its call in progress that the failing step did not (that step told its own: the boards'
        or the links'), so that nobody waits out its deadline."""
        self._broken = str(exc) or type(exc).__name__
        if self._failure is None:
            self._failure = exc
        self._front_end_update()
        record_failure(self.rank, exc)  # for ddlrun: who failed first
        # The reason without our "rank R: " prefix.
        code, reason = abort_code(exc), engine.failure_reason(exc)
        for path in self._paths:
            path.abort(code, reason)
        if running is None and self._ctx.boards is not None:  # the checks before any path
            self._ctx.boards.abort(code, reason)

    def _integer_avg(self, call: Call, seq: int) -> Any:
        """An integer avg, exact (``int_avg``): device buffers through host memory."""
        assert call.inp is not None and call.out is not None
        if call.inp.memory != MemoryKind.CUDA:
            int_avg.run(call, self.size, None, lambda wide: self._execute(wide, seq))
            return call.result
        with device.on_device(call.inp.device):
            host = self._ctx.host_arrays(call)
            int_avg.run(call, self.size, host, lambda wide: self._execute(wide, seq))
            self._ctx.pinned().upload(host[1], call.out.array)
        return call.result

    def add_before_collective(self, fn: Callable[[], Any]) -> Callable[[], None]:
        """Call ``fn()`` on the calling thread before each collective this communicator starts
        (synchronous or async), so that work a layer above has deferred goes first, in the same
        order on every rank. Collectives ``fn`` itself starts do not call the hooks again.
        Returns a function that removes the hook.

        The PyTorch `DistributedOptimizer` uses it to send the gradient buckets backward has not
        completed before a collective the training loop issues between backward and ``step()``.
        """
        self._before_collective.append(fn)
        self._front_end_update()

        def remove() -> None:
            self._before_collective.remove(fn)
            self._front_end_update()

        return remove

    def _front_end_update(self) -> None:
        """The front end takes calls only while the Python path would add nothing: no hooks
        to call, not failed, not closing."""
        if self._front is not None:
            with self._front_lock:  # a failure on another thread must not be undone
                self._front.enabled = not (
                    self._before_collective or self._broken is not None or self._closed
                )

    def _front_end_failed(
        self,
        status: int,
        kind: int,
        seq: int,
        x: Any,
        out: Any,
        op: Op | None,
        root: int,
        mode: int,
    ) -> BaseException:
        """A call of the front end failed with native ``status``: its error, as the Python
        path names it, with the boards' peers told (`HostCollectives.failed`)."""
        call = calls.prepare(frontend.KINDS[hostcoll.BoardKind(kind)], x, op, out, root, self.size)
        assert self._host is not None
        return self._host.failed(status, paths.label(call, seq), mode, (x, out))

    def _front_end_broken(self, err: BaseException, slot: int) -> None:
        """Then: break the communicator as the Python path does after a failed board step
        (its links told too), record the call as failed, raise ``err``."""
        self._boards_path.failed_on_boards()
        self._fail(err, self._boards_path)
        err = self._revoked_instead(err) or err
        if self._flight.enabled:
            self._flight.call_failed(err, slot)
        raise err

    def _front_end_links_failed(self, err: BaseException, slot: int) -> None:
        """A call of the front end failed on the links (the engine told them): break the
        communicator as the Python path does, record the call as failed, raise ``err``."""
        self._fail(err, self._schedule_path)
        err = self._revoked_instead(err) or err
        if self._flight.enabled:
            self._flight.call_failed(err, slot)
        raise err

    def hold_worker(self) -> contextlib.AbstractContextManager[None]:
        """A block whose async calls run on the calling thread, for a caller that waits on
        them at once: a call runs before ``*_async`` returns when nothing is queued before it,
        else its `Handle.wait()` runs it when its turn comes. That spares the hand-off to the
        background worker and back (tens of microseconds, more on a busy machine). Whatever is
        still queued when the block ends goes to the worker then.
        """
        return self._executor.hold()

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
            lambda: Handle(f"rank {self.rank}: {call.collective}", self.wait_budget()),
        )

    def _submit(self, call: Call) -> Handle:
        if self._before_collective:
            self._run_hooks()
        handle = Handle(f"rank {self.rank}: {call.collective}", self.wait_budget())
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

    def wait_budget(self) -> float:
        """Seconds a collective issued now may take at most, counting those queued before it
        (each bounded by ``DDL_TIMEOUT``): the deadline a framework gives the handle it wraps."""
        return self.timeout * (self._executor.pending() + 1) + 5.0

    @property
    def closed(self) -> bool:
        """Whether `close` was called."""
        return self._closed

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
        front = self._front
        if front is not None:
            result = front.allreduce(x, op, out)
            if result is not frontend.DECLINED:
                return result
        return self._run(calls.prepare(Collective.ALLREDUCE, x, op, out, 0, self.size))

    def allreduce_async(self, x: Any, op: str | Op = "sum", out: Any = None) -> Handle:
        """`allreduce` in the background; returns a `Handle` (``wait()`` gives the result).
        ``x`` and ``out`` must not be touched until the handle completes."""
        return self._submit(calls.prepare(Collective.ALLREDUCE, x, op, out, 0, self.size))

    def reduce_scatter(self, x: Any, op: str | Op = "sum", out: Any = None) -> Any:
        """Reduce ``x`` (size * k elements) over all ranks; rank r gets block r (k elements).

        A multi-dimensional ``x`` whose first dimension divides by size is split along it
        (output shape ``(shape[0] // size, *shape[1:])``); otherwise the output is 1-D.
        Raises ValueError when x's element count is not divisible by size.
        """
        return self._run(calls.prepare(Collective.REDUCE_SCATTER, x, op, out, 0, self.size))

    def reduce_scatter_async(self, x: Any, op: str | Op = "sum", out: Any = None) -> Handle:
        return self._submit(calls.prepare(Collective.REDUCE_SCATTER, x, op, out, 0, self.size))

    def allgather(self, x: Any, out: Any = None) -> Any:
        """Concatenate every rank's ``x`` (k elements each) along the first dimension, in rank
        order: the result has size * k elements."""
        return self._run(calls.prepare(Collective.ALLGATHER, x, None, out, 0, self.size))

    def allgather_async(self, x: Any, out: Any = None) -> Handle:
        return self._submit(calls.prepare(Collective.ALLGATHER, x, None, out, 0, self.size))

    def broadcast(self, x: Any, root: int = 0) -> Any:
        """Copy root's ``x`` into ``x`` on every rank (in place); returns ``x``."""
        front = self._front
        if front is not None:
            result = front.broadcast(x, root)
            if result is not frontend.DECLINED:
                return result
        return self._run(calls.prepare(Collective.BROADCAST, x, None, None, root, self.size))

    def broadcast_async(self, x: Any, root: int = 0) -> Handle:
        return self._submit(calls.prepare(Collective.BROADCAST, x, None, None, root, self.size))

    def barrier(self) -> None:
        """Return only after every rank has entered the barrier."""
        if self._front is not None and self._front.barrier():
            return
        self._run(calls.prepare(Collective.BARRIER, None, None, None, 0, self.size))

    # --- lifetime -------------------------------------------------------------------------------
    def revoke(self) -> None:
        """Fail every pending and later call of this communicator, on every rank (ULFM's
        ``MPI_Comm_revoke``, NCCL's ``ncclCommRevoke``).

        The calls in progress on this rank (collectives, async handles, send/recv) and on every
        peer fail with `CommunicatorRevokedError` naming this rank, within a few message
        latencies: the abort reaches the peers this rank is connected to, each passes it on once,
        and a peer that connects later (or after this rank closed) reads it in the store. Later
        calls raise it too. What the output buffers of a failed collective hold is undefined.
        A communicator that already failed has told its peers, and is left as it is (so is one
        revoked before). Any thread may call it, also while `close` waits for queued calls
        (they fail at once then); after `close` there is nothing left to revoke.
        """
        err = CommunicatorRevokedError(
            f"rank {self.rank} revoked the communicator (Communicator.revoke)", self.rank
        )
        self._fail_outside(err, ABORT_REVOKED, "it revoked the communicator (Communicator.revoke)")

    def _fail_outside(self, err: DDLError, code: int | None = None, reason: str = "") -> None:
        """Fail this communicator from outside any call (a revoke; a member silent for the
        heartbeat timeout; this rank fenced): every pending call fails with ``err`` (see
        `_revoked_instead`) and the peers are told (abort ``code``, ``reason``; by default
        those of ``err``). Once: a communicator that failed already is left as it is."""
        with self._revoke_lock:
            if self._failure is not None:
                return
            self._failure, self._broken, self._failed_outside = err, str(err), True
        self._front_end_update()
        if code is None:
            code, reason = abort_code(err), engine.failure_reason(err)
        # The boards first: their peers hear of it before any peer told on the links can fail,
        # close and leave a note of its own there. Whatever a call of ours in flight sees
        # first, `_revoked_instead` names this failure.
        for sink in (self._host, self._node, self._links):
            if sink is not None:
                sink.abort(code, reason)

    def agree(self, flag: bool = True) -> bool:
        """Fault-tolerant agreement (ULFM's ``MPI_Comm_agree``): the AND of ``flag`` over the
        ranks alive to contribute it, the same on every rank that returns, even when ranks die
        during the call (collective; the i-th call on each rank is one agreement).

        It runs over the control plane, not the communicator's links, so it works on a
        communicator that failed or was revoked: it is how a training loop decides whether a
        step is committed after a `PeerFailureError`. A dead rank's flag does not count; which
        ranks are known dead after the call is `failed_ranks`, the same on every rank.

        Raises
        ------
        DDLTimeoutError
            No decision within ``DDL_TIMEOUT`` (a rank hung, or is not calling agree).
        CommunicatorClosedError
            The communicator was closed.
        """
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: agree on a closed communicator")
        if self._agreement is None:  # a world of one
            return bool(flag)
        return self._agreement.agree(bool(flag), self.timeout).value

    def shrink(self) -> Communicator:
        """A new communicator of the ranks still alive (ULFM's ``MPI_Comm_shrink``; collective
        over the survivors), after a `PeerFailureError` or a `revoke`.

        It revokes this communicator first (ranks still waiting in it fail and come to shrink
        too), agrees on who is alive (`failed_ranks` of the decision), and builds the new one
        without the world's rank 0 or its store: the lowest survivor serves a store of its
        own, announced over the control plane. The new ranks are dense, in the old order
        (``new.member_ids[new.rank]`` is this rank's `member_id`), its `epoch` is one more,
        and its topology, links and algorithm choice are those of the new shape. A rank that
        dies during the shrink is left out too (the survivors agree again). This
        communicator is closed on a thread of its own.

        Raises
        ------
        DDLTimeoutError
            No new communicator within ``DDL_TIMEOUT`` (a survivor hung, or never called
            shrink).
        CommunicatorClosedError
            The communicator was closed.
        """
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: shrink of a closed communicator")
        assert self._joiner is not None, "communicators are made by ddlcore.init()"
        if self._shrinking is None:  # a world of one has nobody to lose
            new = self._joiner(0, 1, f"shrink{self._epoch + 1}")
            alive = [0]
        else:
            new, alive = membership.shrink(self, self._shrinking, self._joiner)
        new._epoch = self._epoch + 1
        new._member_ids = tuple(self._member_ids[r] for r in alive)
        # What init set up for this process (its CPU pinning) is the new one's to release.
        new._on_close, self._on_close = self._on_close, None
        if self._shrinking is None:
            self.close()
        else:  # its peers may be gone: nothing here waits for that
            threading.Thread(target=membership.close_quietly, args=(self,), daemon=True).start()
        return new

    @property
    def epoch(self) -> int:
        """How many shrinks made this communicator from the one `init` returned (0 for it)."""
        return self._epoch

    @property
    def member_id(self) -> int:
        """This process's id in the job, kept through shrinks: its rank in the communicator
        `init` (or `split`) made."""
        return self._member_ids[self.rank]

    @property
    def member_ids(self) -> tuple[int, ...]:
        """Every rank's `member_id`, by rank."""
        return self._member_ids

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        """The ranks the last `agree` found dead, the same on every rank that returned from it
        (their flags did not count); () before the first."""
        return tuple(sorted(self._agreement.agreed_failed)) if self._agreement is not None else ()

    def close(self) -> None:
        """Finish queued collectives (within DDL_TIMEOUT), then release connections and threads.

        Rank 0 keeps serving the rendezvous store until its process exits, so ranks that close
        later, or call ``init()`` again, can still reach it; its ``close`` also waits (a few
        seconds at most) until every rank has closed, so that its process's exit cannot take
        the store from a rank still finishing its last collective, or still to read why a
        failed rank left (``ddlcore.job.abort_notes``).
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            self._front_end_update()
        try:
            if self._broken is None:
                self._executor.drain(self.timeout)
            self._p2p.close(self.timeout)
        finally:
            self._flight.closed()
            self._executor.close(5.0)
            for path in self._paths:
                path.close()
            for boards in (self._host, self._node):
                if boards is not None:
                    boards.close()
            if self._links is not None:
                self._links.close()
            if self._store is not None:
                self._count_out(self._prefixed or self._store)
                self._store.close()
            if self._on_close is not None:
                self._on_close()
            if self._unwatch is not None:
                self._unwatch()
            channels = [self._agreement, self._shrinking]
            if any([c.close() for c in channels if c is not None]):
                assert self._plane is not None
                self._plane.close()

    def _count_out(self, store: Any) -> None:
        """Count this rank out in the store; rank 0 waits for the others (see ``close``)."""
        try:
            store.add("closed", 1)
            # Broken too: a rank that reaches a failed peer late reads its abort note there.
            if self.rank == 0 and self.size > 1:
                store.wait_count("closed", self.size, timeout=min(self.timeout, _CLOSE_LINGER_S))
        except Exception:  # a rank that failed or left: closing goes on without it
            _log.debug(
                "rank %d: not every rank counted itself out at close", self.rank, exc_info=True
            )

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- point-to-point and sub-communicators (``ddlcore.p2p``, ``ddlcore.split``) ------------
    def _pair(self, peer: int) -> Any:
        assert self._links is not None  # a world of one has no peer: p2p's checks refuse first
        return self._links.pair(peer)

    def send(self, x: Any, dest: int, tag: int = 0) -> None:
        """Send ``x`` to another rank; return once ``x`` may be reused. Messages
        to one rank with one tag (``0 <= tag < 2**24``) arrive in order; tags match
        independently, never a collective's. DDLError after ``DDL_TIMEOUT`` (``ddlcore.p2p``)."""
        self._p2p.send(x, dest, tag)

    def recv(self, x: Any, source: int, tag: int = 0) -> Any:
        """Receive the next message from ``source`` (``ddlcore.ANY_SOURCE``: from any rank; use
        `irecv` and the handle's ``source`` to learn which) with ``tag`` into ``x``; returns
        ``x``. CollectiveMismatchError when the sender's byte count or dtype differs (the
        message is dropped); DDLTimeoutError after ``DDL_TIMEOUT`` (a later ``recv`` gets the
        message)."""
        return self._p2p.recv(x, source, tag)

    def isend(self, x: Any, dest: int, tag: int = 0) -> Handle:
        """`send` in the background: a `Handle`; ``x`` stays untouched until it completes."""
        return self._p2p.isend(x, dest, tag)

    def irecv(self, x: Any, source: int, tag: int = 0) -> Handle:
        """`recv` in the background: a `Handle` whose ``wait()`` returns ``x`` and whose
        ``source`` is the sender's rank once it completed."""
        return self._p2p.irecv(x, source, tag)

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """MPI_Comm_split (collective): the ranks of one ``color`` form a new `Communicator`
        ranked by ``(key, rank)``; None (or a negative color) gives None. Parent and child close
        independently; the world's rank 0 process serves their store: it must outlive them."""
        assert self._joiner is not None, "communicators are made by ddlcore.init()"
        self._splits += 1
        return split_communicator(self, color, key, f"split{self._splits}", self._joiner)

    def join_group(self, rank: int, size: int, name: str) -> Communicator:
        """A child that only its members make (``MPI_Comm_create_group``; torch's
        ``new_group``): not collective over this communicator, only over the ``size`` ranks
        that call it with the same ``name``; this rank is ``rank`` of them. Parent and child
        close independently."""
        assert self._joiner is not None, "communicators are made by ddlcore.init()"
        return self._joiner(rank, size, f"group/{name}")
