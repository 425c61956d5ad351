"""`ShmPair`: the two rings between this rank and a peer (ours in its inbox, its in ours):
attaching, requests, moving bytes (the caller's thread or the progress thread), the peer's
state (closed, aborted) and this pair's failure.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from ddlcore.transports import _shm
from ddlcore.transports.base import MAX_ABORT_REASON_BYTES, Pair, Request
from ddlcore.transports.common import (
    Matcher,
    ThreadRequest,
    abort_error,
    as_view,
    check_tag,
    recv_view,
    timeout_error,
)
from ddlcore.transports.shm.ring import (
    _ABORTED,
    _ATTACHED,
    _CLOSED,
    _CMA,
    _CMA_BLOCK,
    _CMA_MIN,
    _CMA_OK,
    _DATA,
    _GEN_CLOSED,
    _INBOX_HEADER,
    _MAGIC,
    _MAX_NAME,
    _NONE,
    _OFF_ATTACH_GEN,
    _OFF_BELL,
    _OFF_MAGIC,
    _OFF_VERSION,
    _RECORD,
    _S_ABORT,
    _S_ABORT_CODE,
    _S_ABORT_LEN,
    _S_HEAD,
    _S_NAME,
    _S_NAME_LEN,
    _S_PID,
    _S_STATE,
    _S_TAIL,
    _SLOT,
    _SLOT_HEADER,
    _SPIN_S,
    _VERSION,
    Incoming,
    RingEnds,
    Send,
    ShmRequest,
    inbox_bytes,
)
from ddlcore.transports.shm.segments import SHM_DIR, reserve_pages

from ddlcore.errors import CommunicatorClosedError, DDLError, DDLTimeoutError, PeerFailureError

if TYPE_CHECKING:
    from ddlcore.transports.shm.context import ShmContext


class ShmPair(RingEnds, Pair):
    """Both rings between this rank and ``peer``: ours in their inbox (we produce), theirs in
    our inbox (we consume)."""

    def __init__(self, ctx: ShmContext, peer: int) -> None:
        self.rank, self.peer, self._ctx = ctx.rank, peer, ctx
        self._in = ctx._base + _INBOX_HEADER + peer * _SLOT  # their ring to us
        self._in_data = self._in + _SLOT_HEADER
        self._tail = _shm.load_u64(self._in + _S_TAIL)
        self._out = 0  # our ring in their inbox, once attached
        self._out_data = 0
        self._head = 0
        self._peer_base = 0
        self._peer_bytes = 0
        self._peer_bell = 0
        self._peer_pid = 0
        self._pidfd = -1
        self._connected = False
        self._plock = threading.Lock()  # send queue and our ring's head
        self._clock = threading.Lock()  # posted, unexpected, incoming record, our ring's tail
        self._sendq: deque[Send] = deque()
        # Receives and messages by tag; failure (abort, close) and lost (the peer closed, died)
        self._matcher: Matcher[ShmRequest] = Matcher(self.rank, peer, "shm")
        self._incoming: Incoming | None = None
        self._closed = False
        self._announced = _ATTACHED  # what we last told the peer (or will, once attached)
        self._abort_note: tuple[int, bytes] = (0, b"")
        self._watched = False
        self._cma = _CMA_OK  # and the peer is in our pid namespace: see _attach
        self._msgno = 0  # CMA messages sent (``_plock``)
        self._await_ack: dict[int, ShmRequest] = {}  # CMA sends the peer has not read yet
        self._acks: deque[int] = deque()  # CMA messages read, to acknowledge (``_clock``)
        self._driving = 0  # threads in _drive on this pair (guarded by the context's _drivers)

    # --- attaching --------------------------------------------------------------------------
    def _attach(self, name: str, pid: int) -> None:
        """Map the peer's inbox and announce ourselves in our slot there."""
        path = os.path.join(SHM_DIR, name)
        nbytes = inbox_bytes(self._ctx.size)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise PeerFailureError(
                f"rank {self.rank} cannot open rank {self.peer}'s shared memory {path}: it is "
                "gone, so that rank closed its transport or exited (or runs on another host: "
                "use DDL_TRANSPORT=auto or tcp across hosts)",
                self.peer,
            ) from None
        try:
            if os.fstat(fd).st_size != nbytes:
                raise PeerFailureError(
                    f"rank {self.peer}'s shared memory {path} has {os.fstat(fd).st_size} bytes, "
                    f"rank {self.rank} expected {nbytes}: the ranks disagree on the world size",
                    self.peer,
                )
            reserve_pages(
                fd,
                _INBOX_HEADER + self.rank * _SLOT,
                _SLOT,
                f"rank {self.rank}'s ring to rank {self.peer}",
            )
            base = _shm.map_shared(fd, nbytes)
        finally:
            os.close(fd)
        if (
            _shm.load_u64(base + _OFF_MAGIC) != _MAGIC
            or _shm.load_u32(base + _OFF_VERSION) != _VERSION
        ):
            _shm.unmap(base, nbytes)
            raise PeerFailureError(
                f"{path} is not a ddlcore shm inbox of protocol version {_VERSION}", self.peer
            )
        out = base + _INBOX_HEADER + self.rank * _SLOT
        self._peer_base, self._peer_bytes, self._peer_pid = base, nbytes, pid
        self._peer_bell = base + _OFF_BELL
        self._head = _shm.load_u64(out + _S_HEAD)
        me = self._ctx.name.encode()
        _shm.store_u32(out + _S_PID, os.getpid())
        _shm.store_u32(out + _S_NAME_LEN, len(me))
        _shm.put_bytes(out + _S_NAME, me)
        _shm.store_u32(out + _S_STATE, _ATTACHED)
        if _shm.fetch_add_u32(base + _OFF_ATTACH_GEN, 1) & _GEN_CLOSED:
            # It closed before it could see us: nothing will ever come from it.
            self._detach()
            raise PeerFailureError(
                f"rank {self.rank} reached rank {self.peer}'s shared memory as that rank closed "
                "its transport",
                self.peer,
            )
        try:  # after the check: the progress thread watches a pidfd it sees, never a closed one
            self._pidfd = os.pidfd_open(pid)
        except OSError:  # already gone, or another pid namespace: the deadline still applies
            self._pidfd = -1
            self._cma = False  # its pid may not name it here: keep data in the ring
        self._out, self._out_data = out, out + _SLOT_HEADER
        self._connected = True
        _shm.bell_ring(self._peer_bell)
        if self._announced != _ATTACHED:  # we aborted or closed before attaching: say so now
            self._announce(self._announced, *self._abort_note)

    def _detach(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
        if self._peer_base:
            _shm.unmap(self._peer_base, self._peer_bytes)
            self._peer_base = self._out = self._out_data = self._peer_bell = 0

    # --- requests ---------------------------------------------------------------------------
    def isend(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = as_view(view)
        check_tag(tag, check)
        req = ShmRequest(self, view, tag, check, True)
        with self._plock:
            if self._failure is not None or self._lost is not None:
                req._fail(self._error_for(req))
                return req
            if self._cma and req.nbytes >= _CMA_MIN:
                msgno = self._msgno = self._msgno + 1
                self._await_ack[msgno] = req  # before the peer can possibly answer
                record = _RECORD.pack(_CMA, check, tag, req.nbytes, msgno) + _CMA_BLOCK.pack(
                    _shm.address_of(view), 0, 0, 0
                )
                self._sendq.append(Send(req, record, _CMA))
            else:
                self._sendq.append(
                    Send(req, _RECORD.pack(_DATA, check, tag, req.nbytes, 0), _DATA, view)
                )
            if len(self._sendq) == 1 and self._connected:
                self._push()  # idle pair: straight into the ring from this thread
            pending = bool(self._sendq)
        if pending:
            self._ctx._wake()
        return req

    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        view = recv_view(view, tag, check)
        req = ShmRequest(self, view, tag, check, False)
        self._matcher.post(req)
        return req

    def _timeout_error(self, req: ThreadRequest, timeout: float) -> DDLTimeoutError:
        note = (
            ""
            if self._connected
            else f" (rank {self.peer} has not connected to rank {self.rank} yet)"
        )
        if not self._connected and _shm.load_u32(self._in + _S_STATE) != _NONE:
            note = ""
        return timeout_error(self.rank, self.peer, req, timeout, note)

    def _progress(self) -> bool:
        """One round for this pair: peer state, sends, receives. True if anything moved."""
        moved = False
        state = _shm.load_u32(self._in + _S_STATE)
        if state == _ABORTED and self._failure is None:
            self._peer_aborted()
            return True
        if state == _ATTACHED and not self._connected and not self._closed:
            self._attach_back()
        if self._sendq and self._connected:
            with self._plock:
                if self._sendq and self._failure is None and self._lost is None:
                    moved = self._push()
        with self._clock:
            if self._failure is None:
                moved = self._pull() or moved
        if self._acks:
            self._send_acks()
        if state == _CLOSED and self._lost is None:
            self._peer_gone(f"rank {self.peer} closed its connection while")
            moved = True
        return moved

    def _drive(self, req: ShmRequest, budget: float) -> None:
        """Move this pair's bytes from the waiting thread until ``req`` is done or ``budget``
        seconds pass, sleeping on our doorbell (rung by the peer when it publishes data or frees
        space, and by ``req`` when another thread finishes it)."""
        ctx = self._ctx
        bell = ctx._bell
        end = time.monotonic() + budget
        with ctx._drivers:
            if ctx._closed:  # the mappings may be gone: leave it to the request's lock
                return
            ctx._driving += 1
            self._driving += 1
        try:
            while not req._done:
                seen = _shm.bell_seq(bell)
                try:
                    self._progress()
                except DDLError as exc:
                    self._fail_pair(exc)
                left = end - time.monotonic()
                if req._done or left <= 0:
                    return
                # Spin briefly first: a reply usually comes within microseconds, and a futex
                # sleep costs a wake-up of tens of µs on a busy VM (the MPI transport does same).
                spin_end = time.monotonic() + _SPIN_S
                while _shm.bell_seq(bell) == seen and not req._done:
                    if time.monotonic() > spin_end:
                        # Only while asleep must another thread's completion ring the bell.
                        req._driven = True
                        if not req._done:
                            _shm.bell_wait(bell, seen, left)
                        req._driven = False
                        break
        finally:
            req._driven = False
            with ctx._drivers:
                ctx._driving -= 1
                self._driving -= 1
                ctx._drivers.notify_all()

    def _attach_back(self) -> None:
        """The peer attached to us first: attach to it with the name it left in its slot. Also
        when this pair has failed already (our abort): attached, it tells the peer why."""
        with self._plock:
            if self._connected or self._lost is not None:
                return
            length = _shm.load_u32(self._in + _S_NAME_LEN)
            name = _shm.get_bytes(self._in + _S_NAME, min(length, _MAX_NAME)).decode()
            pid = _shm.load_u32(self._in + _S_PID)
            try:
                self._attach(name, pid)
            except Exception as exc:  # we can still receive what it sent; sending to it fails
                # Also an OSError (no fd, no memory for the mapping): lost, not tried again at
                # every progress round, and never out of close() (`ShmContext._seal`).
                self._matcher.lost = (
                    f"rank {self.rank} could not attach to rank {self.peer} ({exc}), and"
                )

    # --- failure and shutdown ---------------------------------------------------------------
    def _peer_aborted(self) -> None:
        code = _shm.load_u32(self._in + _S_ABORT_CODE)
        length = min(_shm.load_u32(self._in + _S_ABORT_LEN), MAX_ABORT_REASON_BYTES)
        reason = _shm.get_bytes(self._in + _S_ABORT, length).decode("utf-8", "replace")
        error = abort_error(code, self.peer, reason)
        self._ctx._note_abort(error)
        self._fail_pair(error)

    def _peer_gone(self, why: str) -> None:
        """The peer closed or died: what had fully arrived stays receivable, the rest fails."""
        with self._clock:
            if self._failure is None:
                self._pull()
        with self._plock, self._clock:
            self._matcher.lose(why, lambda: self._take_requests(keep_incoming=False))

    def _fail_pair(self, error: DDLError) -> None:
        """Fail every pending and later request (first error wins)."""
        with self._plock, self._clock:
            self._matcher.fail(error, lambda: self._take_requests(keep_incoming=True))

    def _take_requests(self, keep_incoming: bool) -> list[ThreadRequest]:
        """Take out the sends and the receive being filled, to fail them (``_plock`` and
        ``_clock`` held). ``keep_incoming``: the record being read is drained to its end (an
        abort or close); else it is dropped (the peer is gone: nothing more comes)."""
        pending = [item.req for item in self._sendq if item.req is not None]
        pending += self._await_ack.values()
        self._sendq.clear()
        self._await_ack.clear()
        incoming = self._incoming
        if incoming is not None and incoming.req is not None:
            pending.append(incoming.req)
            if keep_incoming:
                incoming.req = incoming.target = None  # drain the rest
        if not keep_incoming:
            self._incoming = None
        return pending

    def _announce(self, state: int, code: int = 0, reason: bytes = b"") -> None:
        """Publish our state in our slot of the peer's inbox and wake it."""
        self._announced = state
        if not self._connected or not self._out:
            return  # _attach announces it once the pair is attached
        if state == _ABORTED:
            _shm.store_u32(self._out + _S_ABORT_CODE, code)
            _shm.store_u32(self._out + _S_ABORT_LEN, len(reason))
            _shm.put_bytes(self._out + _S_ABORT, reason)
        _shm.store_u32(self._out + _S_STATE, state)
        _shm.bell_ring(self._peer_bell)

    def abort(self, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        if self._closed or self._failure is not None:
            return
        self._abort_note = (code, raw)
        self._announce(_ABORTED, code, raw)
        self._fail_pair(abort_error(code, self.rank, reason, peer=self.peer))

    def _begin_close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fail_pair(
            CommunicatorClosedError(
                f"rank {self.rank} closed its shm connection to rank {self.peer} while the request "
                "was pending"
            )
        )
        if self._announced != _ABORTED:
            self._announce(_CLOSED)

    def close(self) -> None:
        self._begin_close()
