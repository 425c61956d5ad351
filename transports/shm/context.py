"""`ShmContext`, this rank's inbox segment, progress thread and pairs, and `ShmTransport`, the
backend (ranks of one host).
"""

from __future__ import annotations

import os
import secrets
import select
import threading
import time
import weakref

from ddlcore.transports import _shm
from ddlcore.transports.base import (
    Context,
    HostCollectivesFactory,
    PeerInfo,
    Store,
    Transport,
    TransportOptions,
)
from ddlcore.transports.pairs import PairTableContext
from ddlcore.transports.shm.boards import HostCollectives
from ddlcore.transports.shm.pair import ShmPair
from ddlcore.transports.shm.ring import (
    _ATTACHED,
    _CAP,
    _CLOSE_WAIT_S,
    _GEN_CLOSED,
    _IDLE_WAIT_S,
    _INBOX_HEADER,
    _LIVENESS_S,
    _MAGIC,
    _MAX_NAME,
    _NONE,
    _OFF_ATTACH_GEN,
    _OFF_BELL,
    _OFF_CAP,
    _OFF_MAGIC,
    _OFF_NSLOTS,
    _OFF_PID,
    _OFF_VERSION,
    _POLL_WHILE_DRIVEN_S,
    _S_STATE,
    _SLOT,
    _VERSION,
    inbox_bytes,
)
from ddlcore.transports.shm.segments import (
    PREFIX,
    SHM_DIR,
    create_segment,
    remove_segments_of,
    unlink_quietly,
)

from ddlcore.errors import DDLError, PeerFailureError, StoreUnreachableError


class ShmContext(PairTableContext):
    """This rank's inbox, progress thread and pairs."""

    _label = "shm"

    def __init__(self, rank: int, size: int, store: Store, timeout: float) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        self.rank, self.size, self.store, self.timeout = rank, size, store, float(timeout)
        self.name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}-r{rank}"
        self._bytes = inbox_bytes(size)
        # Sparse: the slots' pages appear as peers attach.
        self.path, self._base = create_segment(
            self.name, self._bytes, _INBOX_HEADER, f"rank {rank}'s inbox"
        )
        # A process that exits without close() still takes its segment's name with it.
        self._unlink_at_exit = weakref.finalize(self, unlink_quietly, self.path)
        base = self._base
        _shm.store_u32(base + _OFF_VERSION, _VERSION)
        _shm.store_u32(base + _OFF_NSLOTS, size)
        _shm.store_u64(base + _OFF_CAP, _CAP)
        _shm.store_u32(base + _OFF_PID, os.getpid())
        _shm.store_u64(base + _OFF_MAGIC, _MAGIC)
        self._bell = base + _OFF_BELL
        self._attach_gen = 0
        self._init_pairs()
        self._pidfds = select.poll()
        self._drivers = threading.Condition()  # waiters moving bytes themselves (ShmPair._drive)
        self._driving = 0
        self._closed = False
        self._stopping = False
        try:
            store.set(f"shm/inbox/{rank}", f"{self.name} {os.getpid()}".encode())
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(
            target=self._progress_loop, daemon=True, name=f"ddl-shm-progress-{rank}"
        )
        self._thread.start()

    # --- pairs ------------------------------------------------------------------------------
    def _new_pair(self, peer: int) -> ShmPair:
        return ShmPair(self, peer)

    def _connect_pair(self, found: ShmPair) -> None:
        """Attach to the peer's inbox (`PairTableContext.pair`), then wake the progress thread."""
        if not found._connected and found._failure is None and found._lost is None:
            name, pid = self._lookup(found.peer)
            with found._plock:
                if not found._connected and found._failure is None and found._lost is None:
                    try:
                        found._attach(name, pid)
                    except PeerFailureError as exc:
                        if _shm.load_u32(found._in + _S_STATE) == _NONE:
                            raise
                        # It wrote to us and left: what it sent is still ours to receive.
                        found._matcher.lost = f"{exc}; so"
        self._wake()

    def _lookup(self, peer: int) -> tuple[str, int]:
        try:
            raw = self.store.get(f"shm/inbox/{peer}", self.timeout)
        except StoreUnreachableError as exc:  # rank 0, which serves the store, is gone
            raise PeerFailureError(
                f"rank {self.rank} could not look up the shared memory of rank {peer}: {exc}", 0
            ) from None
        name, _, pid = raw.decode().partition(" ")
        if not name.startswith(PREFIX) or "/" in name or len(name) > _MAX_NAME:
            raise PeerFailureError(f"rank {peer} published a bad inbox name {name!r}", peer)
        return name, int(pid)

    # --- the progress thread ----------------------------------------------------------------
    def _wake(self) -> None:
        _shm.bell_ring(self._bell)

    def _discover(self) -> None:
        """Peers that attached to us before we used the pair get a pair now (their messages
        must be received, and we must be able to tell them when we close)."""
        for peer in range(self.size):
            if (
                peer != self.rank
                and peer not in self._pairs
                and _shm.load_u32(self._base + _INBOX_HEADER + peer * _SLOT + _S_STATE) != _NONE
            ):
                self._pair_for(peer)

    def _progress_loop(self) -> None:
        bell = self._bell
        next_liveness = 0.0
        while not self._stopping:
            seen = _shm.bell_seq(bell)
            gen = _shm.load_u32(self._base + _OFF_ATTACH_GEN)
            if gen != self._attach_gen:
                self._attach_gen = gen
                self._discover()
            moved = False
            for p in self._pair_list():
                if p._driving:  # a waiting thread is moving this pair's bytes right now
                    continue
                try:
                    moved = p._progress() or moved
                except DDLError as exc:
                    p._fail_pair(exc)
                except Exception as exc:  # a bug must fail the pair, not silently stop progress
                    p._fail_pair(
                        PeerFailureError(
                            f"rank {self.rank}: internal error in the shm progress thread towards "
                            f"rank {p.peer}: {exc!r}",
                            p.peer,
                        )
                    )
                if p._pidfd >= 0 and not p._watched:  # only this thread touches the poll set
                    p._watched = True
                    self._pidfds.register(p._pidfd, select.POLLIN)
            now = time.monotonic()
            if now >= next_liveness:
                next_liveness = now + _LIVENESS_S
                self._check_liveness()
            if moved:
                continue
            if self._driving:
                # Waiting threads are moving bytes and sleep on the doorbell themselves: poll
                # instead of sleeping there too, so each message wakes one thread, not two.
                time.sleep(_POLL_WHILE_DRIVEN_S)
            else:
                _shm.bell_wait(bell, seen, _IDLE_WAIT_S)

    def _check_liveness(self) -> None:
        dead = {fd for fd, _ in self._pidfds.poll(0)}
        if not dead:
            return
        for p in self._pair_list():
            if p._watched and p._pidfd in dead:
                p._watched = False
                self._pidfds.unregister(p._pidfd)
                # Survivors clean up (before anyone hears of it and exits): the dead rank's
                # segments would otherwise outlive the job.
                remove_segments_of({p._peer_pid})
                p._peer_gone(f"rank {p.peer} (pid {p._peer_pid}) exited while")

    # --- shutdown ---------------------------------------------------------------------------
    def host_collectives(self) -> HostCollectivesFactory:
        """The boards (``boards.HostCollectives``): collectives of this host's ranks as one
        native call each through shared memory."""
        return HostCollectives

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stopping = True
        self._wake()
        self._thread.join()
        with self._drivers:  # nobody may touch the mappings once they are gone
            self._drivers.wait_for(lambda: self._driving == 0, timeout=_CLOSE_WAIT_S)
        pairs = self._seal()
        for p in pairs:
            p._begin_close()
        for p in pairs:
            p._detach()
        self._release()

    def _seal(self) -> list[ShmPair]:
        """Refuse attaches from now on (`_GEN_CLOSED`) and take in every peer that attached
        before: each is attached back, so that the close (or our abort) reaches it, instead of
        a receive from us waiting out its deadline. The progress thread has stopped."""
        _shm.fetch_add_u32(self._base + _OFF_ATTACH_GEN, _GEN_CLOSED)
        self._discover()
        pairs = self._pair_list()
        for p in pairs:
            if not p._connected and _shm.load_u32(p._in + _S_STATE) == _ATTACHED:
                p._attach_back()
        return pairs

    def _release(self) -> None:
        _shm.unmap(self._base, self._bytes)
        self._unlink_at_exit()


class ShmTransport(Transport):
    """Shared memory between ranks of one host (same hostname and network namespace)."""

    name = "shm"

    @classmethod
    def is_available(cls, options: TransportOptions | None = None) -> tuple[bool, str]:
        if not os.path.isdir(SHM_DIR) or not os.access(SHM_DIR, os.W_OK):
            return False, f"{SHM_DIR} is missing or not writable (mount a tmpfs there)"
        if not hasattr(os, "pidfd_open"):
            return False, "needs Linux >= 5.3 and Python >= 3.9 (os.pidfd_open)"
        return True, ""

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return me.host_id == peer.host_id

    def create_context(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        options: TransportOptions | None = None,
    ) -> Context:
        return ShmContext(rank, size, store, timeout)
