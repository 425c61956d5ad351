"""Point-to-point messages of a `Communicator`: ``send``/``recv`` and their async forms.

Each message is two transport messages on the pair: a 16-byte header (the sender's byte count,
dtype code and a check word) and then the data, both in the p2p tag space, apart from every
collective's (transport tags ``(0xE0000000 | tag) << 32 | slot``, slot 0 the header, 1 the
data; the MPI transport gives that space a communicator of its own). So a receive compares
the sender's size and dtype with its own before any data lands: a mismatch is a
`CollectiveMismatchError` naming both ranks, and the data is still drained (into scratch
memory), so the next message on that (source, tag) is received intact.

Ordering: each (peer, tag, direction) is a `_Channel`. Its messages are posted in call order
and completed, in that order, by a thread of the channel's own (started when it has work, gone
when idle; a blocking call on an idle channel completes its own message instead), so different
tags and peers never wait for each other, and a receive whose sender is late blocks only later
receives of the same (source, tag), as in MPI. A receive that timed out leaves its header
receive posted; the next receive on that channel takes it over, so no message is lost or taken
out of order.

A receive from any rank (``source=ANY_SOURCE``, MPI_ANY_SOURCE) is a channel of its own per
tag, completed in call order: it keeps a header receive posted on every peer's channel for that
tag and claims the first that arrives on a channel with no receive of its own waiting (a
receive naming its source goes first on that source's messages); the sender's rank is then the
handle's ``source``. A peer that failed or left is passed over while another may still send.
Headers it posted and did not claim stay posted for later receives.

Rules: ``dest``/``source`` must be another rank of the communicator (no self-sends, as in
torch.distributed); ``0 <= tag < 2**24``. Device buffers go through host memory: a send copies
them out once the work queued on their stream is done, a receive copies the message in before
its handle completes. Point-to-point traffic does not go through the collectives' in-order
executor: a blocking ``recv`` does not delay collectives called on other threads, and a failed
send or receive does not break the communicator.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddlcore import device
from ddlcore.buffers import BufferDesc, MemoryKind, as_buffer
from ddlcore.errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    rewrap,
)
from ddlcore.handles import Handle
from ddlcore.kernels.dtypes import DType, dtype_name, numpy_dtype
from ddlcore.transports.base import Request

HISTORY = 64  # point-to-point messages a flight record shows, the newest (a debugging aid)
MAX_TAG = (1 << 24) - 1
ANY_SOURCE = -1  # recv's source: the first message from any rank (MPI_ANY_SOURCE)
P2P_SPACE = 0xE0000000  # top bits of a transport tag's upper half: p2p (see the docstring)
_CHECK = 0x50325021  # "P2P!": every p2p message carries it, so no collective's receive takes one
_HEADER = struct.Struct("<QiI")  # nbytes, dtype code, check word
_HEADER_SLOT, _DATA_SLOT = 0, 1


def transport_tag(tag: int, slot: int) -> int:
    """The 64-bit transport tag of a p2p message's header (slot 0) or data (slot 1)."""
    return ((P2P_SPACE | tag) << 32) | slot


@dataclass(slots=True)
class _Record:
    """What the flight record shows of one send or receive (times on the wall clock)."""

    op: str  # "send" or "recv"
    peer: int | None  # None: a receive from any rank, not matched yet
    tag: int
    nbytes: int
    posted: float
    end: float = 0.0  # 0.0 while in flight
    error: str | None = None  # the failure's type name


@dataclass
class _Job:
    handle: Handle
    deadline: float
    buf: BufferDesc
    result: Any = None  # what wait() returns: a receive's x
    requests: tuple[Request, ...] = ()  # a send's: header and data
    record: _Record | None = None  # what the flight record shows of it (None: internal)


@dataclass
class _Channel:
    """The messages to or from one peer with one tag, in call order."""

    peer: int
    tag: int
    sending: bool
    jobs: deque[_Job] = field(default_factory=deque)
    headers: deque[tuple[Request, bytearray]] = field(default_factory=deque)  # posted, unclaimed
    thread: threading.Thread | None = None  # the one completing its jobs
    broken: str | None = None


class PointToPoint:
    """The p2p side of one communicator: its channels and their threads."""

    def __init__(
        self,
        rank: int,
        size: int,
        pair: Callable[[int], Any],
        timeout: float,
        explain: Callable[[DDLError], DDLError] | None = None,
    ) -> None:
        self.rank, self.size, self.timeout = rank, size, timeout
        self._pair = pair
        self._explain = explain  # what a peer that is gone left a note of (`Links.explain`)
        self._lock = threading.Lock()
        self._channels: dict[tuple[int, int, bool], _Channel] = {}
        self._any_next: dict[int, int] = {}  # per tag: where a receive from any rank looks first
        self._history: deque[_Record] = deque(maxlen=HISTORY)  # the newest jobs' records
        self._closed = False

    # --- arguments ------------------------------------------------------------------------------
    def _check(
        self, x: Any, peer: Any, tag: Any, peer_name: str, writable: bool
    ) -> tuple[BufferDesc, int, int]:
        """x's descriptor, and peer and tag as Python ints (NumPy's would overflow a tag)."""
        for name, value in ((peer_name, peer), ("tag", tag)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"{name} must be an int, not {type(value).__name__}")
        any_source = writable and peer == ANY_SOURCE and self.size > 1
        if (not 0 <= peer < self.size or peer == self.rank) and not any_source:
            also = " or ANY_SOURCE" if writable and self.size > 1 else ""
            raise ValueError(
                f"{peer_name}={peer}: rank {self.rank} of {self.size} can only exchange "
                f"messages with another rank in [0, {self.size}){also} (no self-sends)"
            )
        if not 0 <= tag <= MAX_TAG:
            raise ValueError(f"tag={tag} must be in [0, {MAX_TAG}]")
        desc = as_buffer(x, "x")
        if writable and desc.readonly:
            raise ValueError("x is read-only: recv writes into it")
        return desc, int(peer), int(tag)

    def _channel(self, peer: int, tag: int, sending: bool) -> _Channel:
        key = (peer, tag, sending)
        ch = self._channels.get(key)
        if ch is None:
            ch = self._channels[key] = _Channel(peer, tag, sending)
        return ch

    def _label(self, sending: bool, peer: int, tag: int, nbytes: int) -> str:
        if sending:
            return f"rank {self.rank}: send of {nbytes} bytes to rank {peer} with tag {tag}"
        source = "any rank" if peer == ANY_SOURCE else f"rank {peer}"
        return f"rank {self.rank}: recv of {nbytes} bytes from {source} with tag {tag}"

    def _why(self, exc: BaseException, label: str) -> BaseException:
        """``exc``, or the abort the peer it blames left a note of, after ``label``."""
        if self._explain is None or not isinstance(exc, DDLError):
            return exc
        told = self._explain(exc)
        return exc if told is exc else rewrap(told, f"{label}: {told}")

    # --- posting --------------------------------------------------------------------------------
    def send(self, x: Any, dest: int, tag: int) -> None:
        self._finish_inline(*self._post_send(x, dest, tag, True))

    def isend(self, x: Any, dest: int, tag: int) -> Handle:
        return self._post_send(x, dest, tag, False)[1].handle

    def recv(self, x: Any, source: int, tag: int) -> Any:
        return self._finish_inline(*self._post_recv(x, source, tag, True))

    def irecv(self, x: Any, source: int, tag: int) -> Handle:
        return self._post_recv(x, source, tag, False)[1].handle

    def _post_send(self, x: Any, dest: int, tag: int, inline: bool) -> tuple[_Channel, _Job, bool]:
        desc, dest, tag = self._check(x, dest, tag, "dest", False)
        handle = Handle(self._label(True, dest, tag, desc.nbytes), self.timeout + 5.0)
        header = _HEADER.pack(desc.nbytes, int(desc.code), _CHECK)
        data = None
        if desc.nbytes:
            data = desc.view() if desc.memory == MemoryKind.HOST else _download(x, desc)
        with self._lock:
            self._open()
            ch = self._channel(dest, tag, True)
            try:  # the first message to ``dest`` connects
                pair = self._pair(dest)
                reqs = [pair.isend(memoryview(header), transport_tag(tag, _HEADER_SLOT), _CHECK)]
                if data is not None:
                    reqs.append(pair.isend(data, transport_tag(tag, _DATA_SLOT), _CHECK))
            except DDLError as exc:
                failed = exc  # explained below, without the lock: it may ask the store
            else:
                job = _Job(handle, time.monotonic() + self.timeout, desc, None, tuple(reqs))
                self._record(job, "send", dest, tag)
                return ch, job, self._enqueue(ch, job, inline)
        raise self._why(failed, handle.label)

    def _post_recv(
        self, x: Any, source: int, tag: int, inline: bool
    ) -> tuple[_Channel, _Job, bool]:
        desc, source, tag = self._check(x, source, tag, "source", True)
        handle = Handle(self._label(False, source, tag, desc.nbytes), self.timeout + 5.0)
        if source != ANY_SOURCE:
            handle.source = source
        with self._lock:
            self._open()
            ch = self._channel(source, tag, False)
            try:  # the first message from ``source`` connects
                if source != ANY_SOURCE:
                    self._spare_header(ch)
            except DDLError as exc:
                failed = exc  # explained below, without the lock: it may ask the store
            else:
                job = _Job(handle, time.monotonic() + self.timeout, desc, x)
                self._record(job, "recv", source, tag)
                return ch, job, self._enqueue(ch, job, inline)
        raise self._why(failed, handle.label)

    def _record(self, job: _Job, op: str, peer: int, tag: int) -> None:
        job.record = _Record(
            op, None if peer == ANY_SOURCE else peer, tag, job.buf.nbytes, time.time()
        )
        self._history.append(job.record)

    def _spare_header(self, ch: _Channel) -> None:
        """Post a header receive for the next receive on ``ch``, unless one is posted already
        (a timed-out receive's, or one a receive from any rank posted)."""
        if len(ch.headers) <= len(ch.jobs):
            raw = bytearray(_HEADER.size)
            req = self._pair(ch.peer).irecv(
                memoryview(raw), transport_tag(ch.tag, _HEADER_SLOT), _CHECK
            )
            ch.headers.append((req, raw))

    def _open(self) -> None:
        if self._closed:
            raise CommunicatorClosedError(f"rank {self.rank}: send/recv on a closed communicator")

    def _enqueue(self, ch: _Channel, job: _Job, inline: bool) -> bool:
        """Queue ``job``; True when the caller is to complete it itself (a blocking call on an
        idle channel: no thread to start and hand over to, which costs more than a small
        message's round trip)."""
        ch.jobs.append(job)
        if ch.thread is not None:
            return False
        if inline:
            ch.thread = threading.current_thread()
            return True
        self._start_thread(ch)
        return False

    def _start_thread(self, ch: _Channel) -> None:
        ch.thread = threading.Thread(
            target=self._drain,
            args=(ch,),
            name=f"ddlcore-rank{self.rank}-p2p-{ch.peer}-{ch.tag}",
            daemon=True,
        )
        ch.thread.start()

    def _finish_inline(self, ch: _Channel, job: _Job, mine: bool) -> Any:
        if mine:
            self._drain(ch, until=job)
        return job.handle.wait()

    # --- completing, on the channel's thread (or a blocking call's) ------------------------------
    def _drain(self, ch: _Channel, until: _Job | None = None) -> None:
        """Complete the channel's jobs in order: all of them, or up to ``until`` (a blocking
        call's own), leaving the rest to a thread."""
        while True:
            with self._lock:
                if until is not None and until.handle.done():
                    if ch.jobs:
                        self._start_thread(ch)
                    else:
                        ch.thread = None
                    return
                if not ch.jobs:
                    ch.thread = None
                    return
                job = ch.jobs[0]
            try:
                if ch.broken is not None:
                    raise DDLError(ch.broken)
                if ch.sending:
                    result = self._complete_send(ch, job)
                elif ch.peer == ANY_SOURCE:
                    result = self._complete_recv_any(ch, job)
                else:
                    result = self._complete_recv(ch, job)
            except BaseException as exc:  # delivered to whoever waits on the handle
                error: BaseException | None = self._why(exc, job.handle.label)
                result = None
            else:
                error = None
            with self._lock:
                ch.jobs.popleft()
            if job.record is not None:
                job.record.end = time.time()
                job.record.error = None if error is None else type(error).__name__
            job.handle._finish(result=result, error=error)

    def _remaining(self, job: _Job) -> float:
        return max(job.deadline - time.monotonic(), 0.0)

    def _complete_send(self, ch: _Channel, job: _Job) -> Any:
        try:
            for req in job.requests:
                req.wait(self._remaining(job))
        except DDLTimeoutError as exc:
            raise DDLTimeoutError(
                f"rank {self.rank}: send to rank {ch.peer} with tag {ch.tag} not received "
                f"within {self.timeout:g} s (DDL_TIMEOUT): did rank {ch.peer} call recv("
                f"source={self.rank}, tag={ch.tag})? ({exc})"
            ) from None
        return None

    def _complete_recv(self, ch: _Channel, job: _Job) -> Any:
        req, raw = ch.headers[0]
        try:
            req.wait(self._remaining(job))
        except DDLTimeoutError:
            if self._remaining(job) > 0.01:  # failed early: an abort that carries a timeout
                with self._lock:
                    ch.headers.popleft()
                raise
            # The header receive stays posted, first in line: the next receive takes it.
            raise DDLTimeoutError(
                f"rank {self.rank}: recv from rank {ch.peer} with tag {ch.tag}: nothing "
                f"arrived within {self.timeout:g} s (DDL_TIMEOUT); did rank {ch.peer} call "
                f"send(dest={self.rank}, tag={ch.tag})?"
            ) from None
        except BaseException:
            with self._lock:
                ch.headers.popleft()
            raise
        with self._lock:
            ch.headers.popleft()
        nbytes, code, check = _HEADER.unpack(raw)
        buf = job.buf
        mismatch = nbytes != buf.nbytes or code != int(buf.code)
        if check != _CHECK:
            ch.broken = (
                f"rank {self.rank}: a message from rank {ch.peer} with tag {ch.tag} has a "
                f"bad header (check {check:#x})"
            )
            raise DDLError(ch.broken)
        if nbytes:
            on_host = buf.memory == MemoryKind.HOST and not mismatch
            view = buf.view() if on_host else memoryview(bytearray(nbytes))
            try:
                self._pair(ch.peer).irecv(view, transport_tag(ch.tag, _DATA_SLOT), _CHECK).wait(
                    max(self._remaining(job), 1.0)
                )
            except DDLError as exc:
                ch.broken = (
                    f"rank {self.rank}: recv from rank {ch.peer} with tag {ch.tag} failed "
                    f"after its header arrived ({exc}); later messages on it cannot be matched"
                )
                raise
            if not on_host and not mismatch:
                _upload(view, buf)
        if mismatch:

            def elements(n: int, c: int) -> str:  # "4000 bytes (1000 x float32)"
                try:
                    return f"{n} bytes ({n // numpy_dtype(DType(c)).itemsize} x {dtype_name(c)})"
                except (ValueError, KeyError):
                    return f"{n} bytes of {dtype_name(c)}"

            raise CollectiveMismatchError(
                f"rank {self.rank}: recv from rank {ch.peer} with tag {ch.tag}: rank "
                f"{ch.peer} sent {elements(nbytes, code)}, rank {self.rank} posted "
                f"{elements(buf.nbytes, int(buf.code))}; the message was dropped"
            )
        return job.result

    def _complete_recv_any(self, ch: _Channel, job: _Job) -> Any:
        """Wait for a header on any peer's channel with this tag that no receive of its own
        waits for, then complete this receive there, as that channel's next receive."""
        peers = [p for p in range(self.size) if p != self.rank]
        failed: set[int] = set()
        pause = 0.0
        while True:
            claimed = None
            with self._lock:
                self._open()
                # Round-robin from the last sender, so no busy rank starves the others.
                start = self._any_next.get(ch.tag, 0) % len(peers)
                for peer in peers[start:] + peers[:start]:
                    src = self._channel(peer, ch.tag, False)
                    self._spare_header(src)
                    if src.jobs or src.thread is not None or src.broken is not None:
                        continue
                    try:
                        ready = src.headers[0][0].test()
                    except DDLError:  # a peer that failed or left: wait for the others
                        failed.add(peer)
                        ready = len(failed) == len(peers)  # none left: report the failure
                    if ready:
                        claimed = _Job(
                            Handle(self._label(False, peer, ch.tag, job.buf.nbytes), 1.0),
                            job.deadline,
                            job.buf,
                            job.result,
                        )
                        src.jobs.append(claimed)
                        src.thread = threading.current_thread()
                        self._any_next[ch.tag] = peers.index(peer) + 1
                        break
            if claimed is not None:
                self._drain(src, until=claimed)
                job.handle.source = src.peer
                if job.record is not None:
                    job.record.peer = src.peer
                return claimed.handle.wait(0)
            if time.monotonic() >= job.deadline:
                raise DDLTimeoutError(
                    f"rank {self.rank}: recv from any rank with tag {ch.tag}: nothing arrived "
                    f"within {self.timeout:g} s (DDL_TIMEOUT); did another rank call "
                    f"send(dest={self.rank}, tag={ch.tag})?"
                )
            # Poll: a receive from any rank is rare, and a transport request has no callback.
            time.sleep(pause)
            pause = min(2 * pause or 20e-6, 1e-3)

    def history(self) -> list[dict[str, Any]]:
        """The newest sends and receives (at most `HISTORY`), oldest first, as the flight
        record holds them: op, peer (None: any rank, not matched yet), tag, bytes, posted, end
        (None while in flight), state (started/completed/failed) and error (its type's name)."""
        with self._lock:
            records = [
                (r.op, r.peer, r.tag, r.nbytes, r.posted, r.end, r.error) for r in self._history
            ]
        return [
            {
                "op": op,
                "peer": peer,
                "tag": tag,
                "bytes": nbytes,
                "posted": posted,
                "end": end or None,
                "state": "started" if not end else "failed" if error else "completed",
                "error": error,
            }
            for op, peer, tag, nbytes, posted, end, error in records
        ]

    def close(self, timeout: float) -> None:
        """Refuse new messages and give the pending sends up to ``timeout`` seconds to leave;
        pending receives fail as the links close under them."""
        with self._lock:
            self._closed = True
            sends = [job.handle for ch in self._channels.values() if ch.sending for job in ch.jobs]
        deadline = time.monotonic() + timeout
        for handle in sends:
            try:
                handle.wait(max(deadline - time.monotonic(), 0.0))
            except DDLError:  # its sender learns of it from the handle; closing goes on
                pass


def _download(x: Any, desc: BufferDesc) -> memoryview:
    """A device buffer's bytes in host memory, once the work queued on its stream is done."""
    ready = device.ready_event(x)
    host = np.empty(desc.nbytes, np.uint8)
    with device.on_device(desc.device):
        if ready is not None:
            ready.synchronize()
        desc.array.reshape(desc.count).view(np.uint8).copy_to_host(host)
    return memoryview(host)  # type: ignore[arg-type]


def _upload(data: memoryview, desc: BufferDesc) -> None:
    """Copy received bytes into a device buffer (synchronously)."""
    with device.on_device(desc.device):
        desc.array.reshape(desc.count).view(np.uint8).copy_to_device(np.frombuffer(data, np.uint8))
