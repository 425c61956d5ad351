"""`UcxProgress`, the progress thread of a `UcxContext`: it drives the UCX worker, takes the
control messages (checking their tokens), matches them against the posted receives, posts the
payloads' receives and finishes what UCX completed. Other threads hand it work through the
context (``_incoming``, ``_binds``, ``_endpoint_events``) and wake it.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
from collections import deque
from typing import TYPE_CHECKING, Any

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES, DeviceView
from ddlcore.transports.common import Message, abort_error, copy_error
from ddlcore.transports.pairs import PairTableContext
from ddlcore.transports.ucx.protocol import (
    _ABORT,
    _CLOSE,
    _DATA,
    _DATA_APART,
    _EAGER_BYTES,
    _FRAME,
    _HEADER,
    _IDLE_WAIT_MS,
    _MAX_CTRL_BYTES,
    _MAX_RANKS,
    _OP_DRAIN,
    _OP_RECV,
    _OP_SEND,
    _OP_TEMP,
    _PROBES_PER_ROUND,
    _SRC_SHIFT,
    _TOKEN_BYTES,
    PROTOCOL_VERSION,
    Control,
    Op,
    _payload_tag,
)

from ddlcore.errors import DDLError

if TYPE_CHECKING:
    from ddlcore.transports.ucx.pair import UcxPair

_log = logging.getLogger("ddlcore")


class UcxProgress(PairTableContext):
    """The progress-thread half of `UcxContext` (which sets every attribute below up): `_run` is
    the thread's body; nothing else here is called from another thread."""

    forged: int
    _lib: Any
    _Array: Any
    _worker: Any
    _poller: select.poll
    _wake_fd: int
    _probe_tag: Any
    _probe_mask: Any
    _incoming: deque[Op]
    _ops: list[Op]
    _endpoint_events: deque[int]
    _ctrl_busy: set[UcxPair]
    _graveyard: list[Any]
    _binds: deque[DeviceView]
    _dirty: bool
    _sleeping: bool
    _stopping: bool

    # --- the loop -------------------------------------------------------------------------------
    def _run(self) -> None:
        worker = self._worker
        try:
            while not self._stopping:
                self._dirty = False
                if self._binds:
                    self._run_binds()
                worker.progress()
                if self._service():
                    continue
                self._sleeping = True
                if self._dirty or self._incoming or self._endpoint_events or not worker.arm():
                    self._sleeping = False
                    continue
                self._poller.poll(_IDLE_WAIT_MS)
                self._sleeping = False
                try:
                    os.eventfd_read(self._wake_fd)
                except BlockingIOError:
                    pass
        except BaseException as exc:  # a bug or a UCX failure: fail everything, never hang
            error = DDLError(
                f"rank {self.rank}: the UCX progress thread failed: {exc!r}; the "
                "UCX context cannot be used any more (report this as a bug)"
            )
            self._note_abort(error)
            for p in list(self._pairs.values()):
                p._fail_pair(error)
            for op in self._ops + list(self._incoming):
                if op.req is not None:
                    op.req._fail(copy_error(error))

    def _run_binds(self) -> None:
        while self._binds:
            self._binds.popleft().bind()

    def _service(self) -> bool:
        """One round of matching and completion; True when anything happened."""
        busy = False
        while self._incoming:
            busy = True
            self._ops.append(self._incoming.popleft())
        drained, taken = self._take_control_messages()
        busy |= taken
        # A failed endpoint is handled only once every message UCX holds has been taken: what
        # arrived before the peer closed or died is still delivered.
        while drained and self._endpoint_events:
            busy = True
            self._endpoint_failed(self._endpoint_events.popleft())
        if self._ops:
            busy |= self._check_ops()
        return busy

    def _endpoint_failed(self, peer: int) -> None:
        pair = self._pairs.get(peer)
        if pair is None or pair._ep is None or self._closed:
            return
        try:
            pair._ep.raise_on_error()
            why = "endpoint closed"
        except Exception as exc:  # "Endpoint 0x7f..00 error: Connection reset by remote peer"
            why = str(exc).partition(" error: ")[2] or str(exc)  # text only: a kept exception's
            # traceback would keep this thread's frames (and the worker) alive
        pair._broken(why)

    # --- control messages -----------------------------------------------------------------------
    def _take_control_messages(self) -> tuple[bool, bool]:
        """Take the control messages UCX holds, and act on those complete, in order per source.
        Returns (every message UCX held was taken, anything was)."""
        worker = self._worker
        taken = 0
        drained = False
        while taken < _PROBES_PER_ROUND:
            probe = worker.tag_probe(self._probe_tag, self._probe_mask, True)
            if not probe.matched:
                drained = True
                break
            taken += 1
            src = (probe.sender_tag.value >> _SRC_SHIFT) & (_MAX_RANKS - 1)
            length = probe.length
            # A message over the cap is received (truncated) all the same, to release it.
            buf = bytearray(min(length, _MAX_CTRL_BYTES))
            ucx_req = worker.tag_recv_with_handle(self._Array(buf), probe)
            if not 0 <= src < self.size or src == self.rank:  # not from a peer: drop it
                self._ops.append(Op(ucx_req, None, _OP_DRAIN, buf=buf))
                continue
            pair = self._pairs.get(src) or self._pair_for(src)
            pair._ctrl.append(Control(ucx_req, buf, length))
            self._ctrl_busy.add(pair)
        for pair in list(self._ctrl_busy):
            fifo = pair._ctrl
            while fifo and fifo[0].ucx.completed:  # in order: UCX keeps one source's order
                ucx_req, buf, length = fifo.popleft()
                taken += 1
                try:
                    ucx_req.check_error()
                    failed = None
                except Exception as exc:  # e.g. truncated: a stranger's, or a peer's bug
                    failed = exc
                frame = memoryview(buf)
                if len(frame) < _FRAME or not hmac.compare_digest(
                    frame[:_TOKEN_BYTES], pair._in_token
                ):
                    self.forged += 1  # not from the rank its tag names: not a word is heard
                    _log.debug(
                        "rank %d dropped a UCX control message of %d bytes claiming to "
                        "be from rank %d: its token is not that rank's",
                        self.rank,
                        length,
                        pair.peer,
                    )
                    continue
                try:
                    if failed is not None:
                        raise failed
                    if length > _MAX_CTRL_BYTES:
                        raise ValueError(
                            f"a control message of {length} bytes (cap {_MAX_CTRL_BYTES})"
                        )
                    self._on_control(pair, frame[_TOKEN_BYTES:])
                except Exception as exc:
                    pair._broken(exc)
            if not fifo:
                self._ctrl_busy.discard(pair)
        return drained, taken > 0

    def _on_control(self, pair: UcxPair, frame: memoryview) -> None:
        if len(frame) < _HEADER.size:
            raise ValueError(f"a control message of {len(frame)} bytes")
        kind, version, check, tag, nbytes, msgno = _HEADER.unpack_from(frame)
        if version != PROTOCOL_VERSION:
            raise ValueError(
                f"rank {pair.peer} speaks UCX protocol {version}, ours is "
                f"{PROTOCOL_VERSION}: run the same ddlcore on every rank"
            )
        pair._heard = True
        body = frame[_HEADER.size :]
        if kind in (_DATA, _DATA_APART):
            eager = kind == _DATA and nbytes <= _EAGER_BYTES
            if len(body) != (nbytes if eager else 0):
                raise ValueError(f"a data header for {nbytes} bytes carrying {len(body)}")
            self._on_data(pair, check, tag, nbytes, msgno, body if eager else None)
        elif kind == _ABORT:
            if nbytes > MAX_ABORT_REASON_BYTES or len(body) != nbytes:
                raise ValueError(f"an abort reason of {nbytes} bytes")
            error = abort_error(check, pair.peer, bytes(body).decode("utf-8", "replace"))
            self._note_abort(error)
            pair._fail_pair(error)
        elif kind == _CLOSE:
            pair._lose(f"rank {pair.peer} closed its UCX connection while")
        else:
            raise ValueError(f"unknown control message kind {kind}")

    def _on_data(
        self, pair: UcxPair, check: int, tag: int, nbytes: int, msgno: int, eager: memoryview | None
    ) -> None:
        matcher = pair._matcher
        msg = Message(check, nbytes, eager, done=eager is not None)
        req = matcher.offer(tag, msg)
        queued = req is None and matcher.failure is None  # else nobody will ask: drop it
        if req is not None:
            error = matcher.mismatch(req, check, nbytes)
            if error is not None:
                req._fail(error)
                req = None  # the payload (if separate) is drained below
        if eager is not None:
            if req is not None:
                if nbytes and not matcher.fill(req, eager):
                    return
                req._complete()
            return
        if req is not None:  # zero copy: UCX writes straight into the posted buffer
            self._post_payload(pair, msgno, req.view, Op(None, pair, _OP_RECV, req=req))
        elif queued:  # nobody asked yet: receive it now, so the sender is not held up
            msg.data = bytearray(nbytes)
            self._post_payload(pair, msgno, msg.data, Op(None, pair, _OP_TEMP, msg=msg))
        else:  # a mismatch, or a pair that failed: take the payload and drop it
            scratch = bytearray(nbytes)
            self._post_payload(pair, msgno, scratch, Op(None, pair, _OP_DRAIN, buf=scratch))

    # --- what UCX holds: payload receives, sends, notices ---------------------------------------
    def _post_payload(self, pair: UcxPair, msgno: int, target: Any, op: Op) -> None:
        if self._binds:  # a device receive posted since this round began
            self._run_binds()
        lib = self._lib
        tag = lib.UCXXTag(_payload_tag(pair._in_token, msgno))
        try:
            op.ucx = self._worker.tag_recv(self._Array(target), tag)
        except Exception as exc:
            pair._broken(exc)
            self._abandon(op)
            return
        if op.ucx.completed:  # the payload had arrived already
            self._finish(op)
        else:
            self._ops.append(op)

    def _check_ops(self) -> bool:
        busy = False
        still = []
        for op in self._ops:
            if op.ucx.completed:
                busy = True
                self._finish(op)
                continue
            pair = op.pair
            if pair is not None and (pair._failure is not None or pair._lost is not None):
                if op.kind in (_OP_RECV, _OP_TEMP, _OP_DRAIN):
                    busy = True
                    self._abandon(op)
                    continue
                if op.kind == _OP_SEND and op.req is not None and not op.req._done:
                    op.req._fail(pair._error_for(op.req))  # UCX keeps the buffer: op stays
            still.append(op)
        self._ops = still
        return busy

    def _finish(self, op: Op) -> None:
        pair, req = op.pair, op.req
        try:
            op.ucx.check_error()
            failed = False
        except Exception as exc:
            failed = True
            if pair is not None:
                pair._broken(exc)
        if pair is None:
            return
        if op.kind == _OP_SEND:
            assert req is not None
            if failed:
                req._fail(pair._error_for(req))
            else:
                req._parts -= 1
                if req._parts == 0:
                    req._complete()
        elif op.kind == _OP_RECV:
            assert req is not None
            if failed:
                req._fail(pair._error_for(req))
            else:
                req._complete()
        elif op.kind == _OP_TEMP:
            assert op.msg is not None
            pair._matcher.settle(op.msg, failed)

    def _abandon(self, op: Op) -> None:
        """The pair failed under a receive UCX has not finished: fail its owner and cancel it
        (dropping a ucxx request cancels it). UCX may still be writing a matched rendezvous
        payload, so a buffer of ours waits in the graveyard until the worker is gone."""
        pair = op.pair
        assert pair is not None
        if op.kind == _OP_RECV:
            assert op.req is not None
            op.req._fail(pair._error_for(op.req))
        elif op.kind == _OP_TEMP:
            assert op.msg is not None
            self._graveyard.append(op.msg.data)
            pair._matcher.settle(op.msg, True)
        else:
            self._graveyard.append(op.buf)
        op.ucx = None
