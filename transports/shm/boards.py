"""The boards: the shm transport's host collectives (`ShmContext.host_collectives`). When every
rank of a communicator is on this host, collectives run straight through shared memory in one
native call each, instead of as point-to-point schedules.

Each rank owns a *board* (``/dev/shm/ddl-<pid>-<random>-board-r<rank>``) that every other rank
maps; the protocol is in ``transports/ddl_arena.h``, its native engine ``transports/_arena.pyx``.
Two paths, chosen by size (the same on every rank):

* **small** (input up to `slots_max` bytes): each rank copies its input into its board's slot,
  one sync point, then every rank reduces all slots in rank order (or copies them, for allgather
  and broadcast). One copy in, P - 1 reductions, ~1 sync: a few microseconds where the engine's
  messages cost tens.
* **direct** (larger, where the kernel lets one process read and write another's memory):
  ranks publish the addresses of their buffers; rank r reduces slice r of the result, chunk by
  chunk, reading slice r of every peer's input with ``process_vm_readv`` into a cache-resident
  buffer, and writes each reduced chunk, while it is still in cache, into every peer's output with
  ``process_vm_writev``. Per rank that is 2n bytes of memory traffic (read n, write n), less than
  a read-based exchange's (3P - 1)/P n, with two sync points per call::

      allreduce, P = 2:   rank 0                           rank 1
        sync 1            publish in/out addresses         publish in/out addresses
        reduce + write    c = in0[:h] + read(in1[:h])      c = read(in0[h:]) + in1[h:]
                          out0[:h] = c; write(out1[:h], c) out1[h:] = c; write(out0[h:], c)
        sync 2            (nobody touches our buffers any more: return)

Every element is reduced once, in rank order, by one rank and copied to the others: results are
bit-identical everywhere. Each sync compares the ranks' check words, so ranks calling different
collectives fail at once with both calls named; a peer that dies is seen through its pidfd; every
wait has the communicator's deadline. ``DDL_ALGO=ring`` (or any schedule algorithm) turns this
path off and runs the schedules over the shm transport instead.

When the ranks span several hosts, each host's ranks get boards of their own, and a collective
that the tuner runs as mdring with the host dimensions first takes its host phases here
(``ddlcore.execution.paths.host_staged``). An allreduce: the "host reduce-scatter" (rank r reduces part r of
every local input into its output, as above but without writing it out), then the rings across
hosts on that part (schedules), then the "host allgather" (each rank reads the others' final
parts out of their outputs); four sync points, and nobody touches the memory a network phase
uses while it runs. Large allreduces do this per segment, the boards' phases of one segment
beside the network phase of another (``ddlcore.execution.pipeline``); each call here then covers one
segment of the buffers. A reduce-scatter or allgather runs plain reduce_scatter or allgather
calls here, on the blocks of the ranks at one network position at a time. Whether direct
reads are on is agreed by every host (``bootstrap``), so all ranks take the same path.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
from ddlcore.transports import _arena, _shm
from ddlcore.transports.base import MAX_ABORT_REASON_BYTES
from ddlcore.transports.common import abort_code, abort_error
from ddlcore.transports.shm.board_calls import (
    DIRECT,
    SLOTS,
    SYNC_ONLY,
    BoardCall,
    BoardKind,
    describe_entry,
)
from ddlcore.transports.shm.segments import (
    PREFIX,
    SHM_DIR,
    cma_allowed,
    create_segment,
    remove_segments_of,
    unlink_quietly,
)

from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    abort_reason,
    rewrap,
)

log = logging.getLogger("ddlcore")

NAME = "direct"  # what DDL_ALGO calls them (``ddlcore.planning.tuning.DIRECT``)
MAX_RANKS = _arena.MAX_RANKS
# Each board's slot (two per board): the largest input the slots take (`slots_max`).
SMALL_MAX = 1 << 18


def slots_max(size: int) -> int:
    """Inputs up to this many bytes go through the slots among ``size`` ranks (one copy in,
    every rank reduces all of them: P - 1 reductions of the whole input each); larger ones are
    read directly (each rank reduces 1/P of it). Medians on the 2-vCPU VM, float32 sum, with
    the compiled front end: np 2, 256 KB slots 35-44 us vs direct 53-54, 1 MB 145-148 vs 163-192
    (a 1 MB slot only for that: not taken); np 4, 128 KB 85 vs 89 us, 256 KB 144 vs 199, 512 KB
    349 vs 333, 1 MB 1230 vs 585. More ranks reduce more slots: 128 KB there, as measured before
    the front end (np 2 then tied at 128 KB)."""
    return SMALL_MAX if size <= 4 else SMALL_MAX // 2


# Direct reads and writes move this much per system call; three such chunks stay in L2 (4 MiB
# here) while reduced. 128 KiB to 1 MiB measured within 10% of each other from 1 MB up.
CHUNK_BYTES = 1 << 18
_MAGIC = 0xDD1C_B0A2_0000_0001
_VERSION = 1
_OFF_MAGIC, _OFF_VERSION, _OFF_SIZE, _OFF_SLOT, _OFF_PID, _OFF_CMA_OK, _OFF_SELF, _OFF_PROBE = (
    0,
    8,
    12,
    16,
    24,
    28,
    32,
    40,
)
# A board's two entries (ddl_arena.h's DDL_A_ENTRY, 64 bytes each, by epoch parity), whose
# first 8 bytes are the call's check word (DDL_E_CHECK): a mismatch names the calls with them.
_OFF_ENTRY, _ENTRY_BYTES = 2048, 64
_CLOSED = 0xFFFF  # abort code of a rank that closed its communicator


_STATUS_TIMEOUT, _STATUS_DEAD, _STATUS_ABORTED, _STATUS_MISMATCH, _STATUS_CMA = 1, 2, 3, 4, 5
# After a failed direct call, how long to wait for peers to stop touching our buffers (they look
# for abort notes before every chunk); also how long close() waits for a call in progress.
_SETTLE_S = 5.0
# After a failed direct call, how long it waits for that (a live peer takes milliseconds): short,
# so a timeout fires within DDL_TIMEOUT + 1 s; past it the buffers are pinned, which keeps safe.
_SETTLE_FAILED_S = 0.5


def _board_bytes() -> int:
    return _arena.HEADER_BYTES + 2 * SMALL_MAX


class HostCollectives:
    """This rank's board and its view of the other local ranks' boards (a
    `HostCollectivesFactory`: the class is what `ShmContext.host_collectives` returns).

    Create it on every rank of a communicator whose ranks all share this host, or on the ranks
    of one host (``rank``/``size`` within them, ``group`` naming them apart from other hosts',
    ``ranks`` their ranks in the communicator),
    then call `connect` (collective: it waits for every rank's board and agrees on direct
    reads)."""

    max_ranks = MAX_RANKS

    def __init__(
        self,
        rank: int,
        size: int,
        store: Any,
        timeout: float,
        group: str = "",
        ranks: Sequence[int] | None = None,
    ) -> None:
        if not 1 < size <= _arena.MAX_RANKS:
            raise ValueError(f"host collectives take 2 to {_arena.MAX_RANKS} ranks, not {size}")
        self.rank, self.size, self.timeout = rank, size, timeout
        self.slots_max = slots_max(size)
        self._key = f"board/{group}"
        # The communicator's rank of each member, for messages (``rank`` and ``q`` index them).
        self.ranks = tuple(ranks) if ranks is not None else tuple(range(size))
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-board-r{rank}"
        self._bytes = _board_bytes()
        self.path, self._base = create_segment(
            self.name, self._bytes, self._bytes, f"rank {rank}'s host-collective board"
        )
        self._unlink_at_exit = weakref.finalize(self, unlink_quietly, self.path)
        base = self._base
        _shm.store_u32(base + _OFF_VERSION, _VERSION)
        _shm.store_u32(base + _OFF_SIZE, size)
        _shm.store_u64(base + _OFF_SLOT, SMALL_MAX)
        _shm.store_u32(base + _OFF_PID, os.getpid())
        _shm.store_u64(base + _OFF_SELF, base)
        _shm.store_u64(base + _OFF_MAGIC, _MAGIC)
        self._maps: list[tuple[int, int]] = []  # (address, bytes) of the peers' boards
        self._pidfds: list[int] = []
        self._pids: list[int] = []
        self._arena: Any = None
        self._boards: list[int] = []  # every rank's board's address, once connected
        self.direct = False  # every rank can read every other's memory (agreed in connect)
        self._closed = False
        # Not a Condition (its notify costs microseconds per call): close() polls _busy.
        # Re-entrant, as the Condition's lock was: close() from a signal handler mid-call.
        self._lock = threading.RLock()
        self._busy = 0  # calls in native code (close() waits for them)
        self._pinned: list[Any] = []  # buffers of failed calls a stopped peer may still write
        try:
            store.set(f"{self._key}{rank}", f"{self.name} {os.getpid()}".encode())
        except BaseException:
            self._release()
            raise

    # --- set-up -------------------------------------------------------------------------------
    def connect(self, store: Any) -> None:
        """Map every rank's board, open its pidfd, and agree on whether direct reads work."""
        boards, self._pids, self._pidfds = [], [], []
        for q in range(self.size):
            if q == self.rank:
                boards.append(self._base)
                self._pids.append(os.getpid())
                self._pidfds.append(-1)
                continue
            name, pid = self._lookup(store, q)
            boards.append(self._map_peer(q, name))
            self._pids.append(pid)
            try:
                self._pidfds.append(os.pidfd_open(pid))
            except OSError:  # gone already, or another pid namespace: the deadline still holds
                self._pidfds.append(-1)
        self._arena = _arena.Arena(
            self.rank, self.size, boards, self._pids, self._pidfds, SMALL_MAX, CHUNK_BYTES
        )
        self._boards = boards
        ok = self._probe_direct(boards)
        _shm.store_u32(self._base + _OFF_CMA_OK, 1 if ok else 0)
        self.run(
            BoardCall(BoardKind.BARRIER, 0, 0, 0, 1, 0, 0, 1, lambda: "host collectives set-up")
        )
        self.direct = all(_shm.load_u32(b + _OFF_CMA_OK) == 1 for b in boards)
        log.debug(
            "rank %d: host collectives over %d boards; direct reads %s",
            self.rank,
            self.size,
            "on" if self.direct else "off",
        )

    def _lookup(self, store: Any, q: int) -> tuple[str, int]:
        raw = store.get(f"{self._key}{q}", self.timeout)
        name, _, pid = raw.decode("utf-8", "replace").partition(" ")
        if not name.startswith(PREFIX) or "/" in name or len(name) > 255 or not pid.isdigit():
            raise PeerFailureError(
                f"rank {self.ranks[q]} published a bad board name {name!r}", self.ranks[q]
            )
        return name, int(pid)

    def _map_peer(self, q: int, name: str) -> int:
        path = os.path.join(SHM_DIR, name)
        me, peer = self.ranks[self.rank], self.ranks[q]
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PeerFailureError(
                f"rank {me} cannot open rank {peer}'s board {path}: that rank closed or exited",
                peer,
            ) from None
        try:
            found = os.fstat(fd).st_size
            if found != self._bytes:
                raise PeerFailureError(
                    f"rank {peer}'s board {path} has {found} "
                    f"bytes, rank {me} expected {self._bytes}: "
                    "different ddlcore versions?",
                    peer,
                )
            base = _shm.map_shared(fd, self._bytes)
        finally:
            os.close(fd)
        self._maps.append((base, self._bytes))
        if (
            _shm.load_u64(base + _OFF_MAGIC) != _MAGIC
            or _shm.load_u32(base + _OFF_VERSION) != _VERSION
            or _shm.load_u32(base + _OFF_SIZE) != self.size
        ):
            raise PeerFailureError(
                f"{path} is not a board of this job's size {self.size} "
                f"(protocol version {_VERSION})",
                peer,
            )
        return base

    def _probe_direct(self, boards: list[int]) -> bool:
        """Read each peer's board magic with process_vm_readv and write it into the board's
        probe word with process_vm_writev: does this kernel allow both?"""
        if not cma_allowed():
            return False
        probe = np.zeros(8, np.uint8)
        magic = np.array([_MAGIC], np.uint64).view(np.uint8)
        for q, base in enumerate(boards):
            if q == self.rank:
                continue
            remote = _shm.load_u64(base + _OFF_SELF)
            if (
                self._pidfds[q] < 0
                or _shm.cma_read(self._pids[q], remote, probe, 0, 8) != 0
                or _shm.cma_write(self._pids[q], remote + _OFF_PROBE, magic, 0, 8) != 0
            ):
                return False
            if (
                int(probe.view(np.uint64)[0]) != _MAGIC
                or _shm.load_u64(base + _OFF_PROBE) != _MAGIC
            ):
                return False
        return True

    @property
    def arena(self) -> Any:
        """The native handle (``_arena.Arena``) once connected, else None."""
        return self._arena

    # --- collectives --------------------------------------------------------------------------
    def mode(self, in_bytes: int) -> int:
        """How a call of ``in_bytes`` runs: `SLOTS`, `DIRECT`, or `SYNC_ONLY` (too large for the
        slots and direct reads are off: the schedules run it, after a sync point here that
        compares the ranks' calls, so a size mismatch across `slots_max` is still caught at
        once)."""
        if in_bytes <= self.slots_max:
            return SLOTS
        return DIRECT if self.direct else SYNC_ONLY

    def run(self, call: BoardCall) -> None:
        """Run one collective (`BoardCall`) on host addresses; with ``mode`` `SYNC_ONLY`, only
        compare the call at a sync point before it runs on the schedules. On failure, leaves
        an abort note the peers see at once and raises a `DDLError` naming this rank,
        ``call.label()`` and the peer concerned."""
        label, mode = call.label, call.mode
        with self._lock:
            if self._closed:
                raise CommunicatorClosedError(
                    f"rank {self.ranks[self.rank]}: {label()}: the communicator is closed"
                )
            self._busy += 1
        try:
            st = self._arena.run(
                mode,
                int(call.kind),
                call.inp,
                call.out,
                call.count,
                call.itemsize,
                call.dtype,
                call.op,
                call.divisor,
                call.root,
                call.check,
                time.monotonic() + self.timeout,
            )
            if st:
                raise self.failed(st, label(), mode, call.keep)
        finally:
            with self._lock:
                self._busy -= 1

    def failed(self, status: int, label: str, mode: int, keep: Any) -> DDLError:
        """After a call (``label``, run in ``mode`` on the buffers ``keep``) ended with native
        ``status``: leave the abort note the peers see at once, make sure none of them still
        touches our buffers (or keep them for good), and return the error to raise. The
        compiled front end (``ddlcore.execution._frontend``) calls it too, while the call
        still counts as in progress."""
        err = self._error(status, label)
        self.abort(abort_code(err), abort_reason(err, str(err).split(": ", 1)[1]))
        if mode == DIRECT and not self._arena.settle(time.monotonic() + _SETTLE_FAILED_S):
            # A stopped peer may still write into them: never give them back.
            self._pinned.append(keep)
        return err

    def _error(self, status: int, label: str) -> DDLError:
        q = self._arena.bad_rank
        peer = self.ranks[q]
        where = f"rank {self.ranks[self.rank]}: {label} via {NAME}"
        if status == _STATUS_TIMEOUT:
            cause = (
                f"rank {peer} did not reach sync point {self._arena.epoch} within "
                f"DDL_TIMEOUT={self.timeout:g} s"
            )
            err: DDLError = DDLTimeoutError(
                f"{where}: {cause}. A peer may have died, be stuck, or be calling a different "
                "collective; raise DDL_TIMEOUT if the job is just slow"
            )
            err.cause = cause
            return err
        if status == _STATUS_DEAD:
            remove_segments_of({self._pids[q]})  # a survivor cleans up for the dead
            return _peer_error(where, f"rank {peer} (pid {self._pids[q]}) exited", peer)
        if status == _STATUS_ABORTED:
            code, reason = self._arena.abort_note(q)
            if q == self.rank:
                return CommunicatorClosedError(
                    f"{where}: the communicator was closed (or failed) "
                    "on another thread during the call"
                )
            if code == _CLOSED:
                return _peer_error(where, f"rank {peer} closed its communicator", peer)
            told = abort_error(code - 1, peer, reason.decode("utf-8", "replace"), peer=peer)
            return rewrap(told, f"{where}: {told}")  # a relayed failure keeps its origin
        if status == _STATUS_MISMATCH:
            cause = (
                f"ranks called different collectives: rank {self.ranks[self.rank]} called "
                f"{self._described(self.rank)}, rank {peer} {self._described(q)}"
            )
            err = CollectiveMismatchError(f"{where}: {cause}")
            err.cause = cause
            return err
        if status == _STATUS_CMA:
            return _peer_error(
                where,
                f"reading or writing rank {peer}'s memory failed: {os.strerror(-self._arena.err)}",
                peer,
            )
        return DDLError(f"{where}: internal error (status {status})")

    def _described(self, q: int) -> str:
        """Rank q's call at our current epoch, by name (`describe_entry`), from its entry and
        the check word beside it."""
        at = self._boards[q] + _OFF_ENTRY + (self._arena.epoch & 1) * _ENTRY_BYTES
        return describe_entry(self._arena.entry(q), _shm.load_u64(at))

    # --- failure and lifetime -----------------------------------------------------------------
    def abort(self, code: int, reason: str) -> None:
        """Leave an abort note (transport abort ``code``) that ends the peers' waits at once.
        Under the lock: close() may otherwise unmap the boards while the note is written."""
        raw = reason.encode("utf-8", "replace")[: min(1024, MAX_ABORT_REASON_BYTES)]
        with self._lock:
            if not self._closed and self._arena is not None:
                self._arena.abort(code + 1, raw)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._arena is not None:
                self._arena.abort(_CLOSED, b"closed")  # ends our own waits too
        deadline = time.monotonic() + _SETTLE_S
        while self._busy:  # read without the lock: it only goes down now (_closed is set)
            if time.monotonic() >= deadline:
                log.warning(
                    "rank %d: a host collective is still running at close(); its "
                    "shared memory stays mapped",
                    self.rank,
                )
                return
            time.sleep(1e-3)
        for fd in self._pidfds:
            if fd >= 0:
                os.close(fd)
        self._pidfds = []
        for base, nbytes in self._maps:
            _shm.unmap(base, nbytes)
        self._maps = []
        self._arena = None
        self._release()

    def _release(self) -> None:
        _shm.unmap(self._base, self._bytes)
        self._unlink_at_exit()


def _peer_error(where: str, cause: str, peer: int) -> PeerFailureError:
    return PeerFailureError(f"{where}: {cause}", peer, cause)
