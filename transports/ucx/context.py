"""`UcxContext`: this rank's UCX context and worker, its pairs, and the progress thread that
drives UCX, takes control messages (checking their tokens), matches them against the posted
receives and finishes what UCX completed.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import struct
import threading
import time
from collections import deque
from typing import Any

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES, DeviceView, Store
from ddlcore.transports.common import Message, abort_error, copy_error, job_key_of
from ddlcore.transports.pairs import PairTableContext
from ddlcore.transports.ucx.options import _features, _import_ucxx, cuda_memory, ucx_options
from ddlcore.transports.ucx.pair import UcxPair
from ddlcore.transports.ucx.protocol import (
    _ABORT,
    _CLOSE,
    _CTRL_KIND,
    _DATA,
    _DATA_APART,
    _EAGER_BYTES,
    _FRAME,
    _GOODBYE_TIMEOUT_S,
    _HEADER,
    _IDLE_WAIT_MS,
    _JOIN_TIMEOUT_S,
    _KIND_SHIFT,
    _MAX_CTRL_BYTES,
    _MAX_RANKS,
    _NONCE_BYTES,
    _OP_DRAIN,
    _OP_NOTICE,
    _OP_RECV,
    _OP_SEND,
    _OP_TEMP,
    _PROBES_PER_ROUND,
    _SRC_SHIFT,
    _TOKEN_BYTES,
    _TOKEN_LABEL,
    PROTOCOL_VERSION,
    Control,
    Op,
    Part,
    UcxRequest,
    _payload_tag,
)

from ddlcore import config
from ddlcore.errors import DDLError

_log = logging.getLogger("ddlcore")


class UcxContext(PairTableContext):
    """This rank's UCX context and worker, its progress thread and its pairs."""

    _label = "UCX"

    def __init__(
        self, rank: int, size: int, store: Store, timeout: float, local_rank: int = 0
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        if size > _MAX_RANKS:
            raise ValueError(f"size={size}: the UCX transport carries at most {_MAX_RANKS} ranks")
        self.rank, self.size, self.timeout, self.store = rank, size, float(timeout), store
        self._key = job_key_of(store, "UCX")
        self._nonce = secrets.token_bytes(_NONCE_BYTES)
        self.forged = 0  # control messages dropped for a wrong token (strangers')
        self._lib, self._Array = _import_ucxx()
        lib = self._lib
        self._init_pairs()  # _lock guards pairs, closed, failure
        self._closed = False
        self._incoming: deque[Op] = deque()  # operations other threads hand to the progress thread
        self._ops: list[Op] = []  # progress thread only
        self._endpoint_events: deque[int] = deque()
        self._ctrl_busy: set[UcxPair] = set()
        self._graveyard: list[Any] = []  # buffers UCX might still write: freed after the worker
        self._dirty = False
        self._sleeping = False
        self._stopping = False
        self._probe_tag = lib.UCXXTag(_CTRL_KIND << _KIND_SHIFT)
        self._probe_mask = lib.UCXXTagMask(0xF << _KIND_SHIFT)
        self._wake_fd = -1
        self._thread: threading.Thread | None = None
        self._bound = False  # the progress thread was given a GPU to make current
        self._binds: deque[DeviceView] = deque()  # views whose GPU it is to make current
        try:
            self._ucx = lib.UCXContext(ucx_options(local_rank=local_rank), _features(lib))
            direct = config.get("DDL_GPU_DIRECT")
            self.device_memory = direct == "on" or (direct == "auto" and cuda_memory(self._ucx))
            self._worker = lib.UCXWorker(self._ucx)
            self._worker.init_blocking_progress_mode()
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._poller = select.poll()
            self._poller.register(self._worker.epoll_file_descriptor, select.POLLIN)
            self._poller.register(self._wake_fd, select.POLLIN)
            self._thread = threading.Thread(
                target=self._run, name=f"ddl-ucx-progress-{rank}", daemon=True
            )
            self._thread.start()
            store.set(f"ucx/addr/{rank}", self._nonce + self._worker.address.tobytes())
        except BaseException:
            self._shutdown()
            raise

    # --- pairs ----------------------------------------------------------------------------------
    def _new_pair(self, peer: int) -> UcxPair:
        return UcxPair(self, peer)

    def _token(self, src: int, dst: int, nonce: bytes) -> bytes:
        """The token of the messages ``src`` sends ``dst`` (whose context's nonce is ``nonce``)."""
        data = nonce + struct.pack("<QQ", src, dst)
        return self._key.derive(_TOKEN_LABEL, data)[:_TOKEN_BYTES]

    # --- handing work to the progress thread ----------------------------------------------------
    def _wake(self) -> None:
        self._dirty = True
        if self._sleeping:
            try:
                os.eventfd_write(self._wake_fd, 1)
            except OSError:  # closed: the thread is gone
                pass

    def _track_send(self, pair: UcxPair, req: UcxRequest, parts: list[Part]) -> None:
        """Complete ``req`` now if UCX already finished every part, else watch what is left."""
        waiting = []
        for ucx_req, buf in parts:
            if ucx_req.completed:
                try:
                    ucx_req.check_error()
                except Exception as exc:
                    pair._broken(exc)
                    req._fail(pair._error_for(req))
            else:
                waiting.append(Op(ucx_req, pair, _OP_SEND, req=req, buf=buf))
        req._parts = len(waiting)
        if not waiting:
            req._complete()
            return
        self._incoming.extend(waiting)
        self._wake()

    def _send_ctrl(self, pair: UcxPair, frame: bytes) -> Any:
        """Best effort: send an ABORT or CLOSE notice; returns its UCX request while UCX still
        holds it (None when done or refused: a broken endpoint tells the peer anyway)."""
        try:
            frame = pair._out_token + frame
            ucx_req = pair._ep.tag_send(self._Array(frame), pair._ctrl_tag)
        except Exception:
            return None
        if ucx_req.completed:
            return None
        self._incoming.append(Op(ucx_req, pair, _OP_NOTICE, buf=frame))
        self._wake()
        return ucx_req

    def _bind_device(self, view: DeviceView) -> None:
        """Before the first device operation: have the progress thread make the view's GPU
        current (it posts device receives and drives UCX's CUDA copies). One GPU per context:
        a rank drives one GPU; UCX finds other GPUs' memory from the pointer."""
        if not self._bound:
            self._bound = True
            self._binds.append(view)
            self._wake()

    def _run_binds(self) -> None:  # progress thread
        while self._binds:
            self._binds.popleft().bind()

    def _on_endpoint_closed(self, peer: int) -> None:
        # Called by ucxx inside worker progress (any thread, UCX locks held): only queue it.
        self._endpoint_events.append(peer)
        self._wake()

    # --- the progress thread --------------------------------------------------------------------
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

    # --- shutdown -------------------------------------------------------------------------------
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.values())
        # Fail everything, and say goodbye to the connected peers (they then fail their requests
        # to us with "closed" rather than "lost"); wait a little for the notices to leave.
        notices = [n for n in (p._goodbye() for p in pairs) if n is not None]
        deadline = time.monotonic() + _GOODBYE_TIMEOUT_S
        while time.monotonic() < deadline and not all(n.completed for n in notices):
            time.sleep(1e-3)
        del notices
        self._shutdown()

    def _shutdown(self) -> None:
        """Stop the progress thread, then release endpoints, requests, worker and context, in
        that order: a ucxx object is freed when its last reference goes, and UCX must not touch
        a buffer after Python frees it (so buffers go last)."""
        self._closed = True
        self._stopping = True
        thread = self._thread
        if thread is not None:
            self._sleeping = True  # make _wake write the eventfd
            self._wake()
            thread.join(_JOIN_TIMEOUT_S)
            if thread.is_alive():  # never free UCX objects under a running progress call
                return
        for p in list(self._pairs.values()):
            ep, p._ep = p._ep, None
            if ep is not None:
                try:
                    ep.remove_close_callback()
                    ep.close_blocking()  # force close: UCX fails what is still in flight on it
                except Exception:  # already failed: nothing left to close
                    pass
            self._graveyard.extend(control.buf for control in p._ctrl)
            for _ in range(len(p._ctrl)):
                p._ctrl.popleft()  # drops (cancels) the UCX request; its buffer stays above
        ops = self._ops + list(self._incoming)
        self._ops, self._ctrl_busy = [], set()
        self._incoming.clear()
        for op in ops:
            self._graveyard.append(op.msg.data if op.msg is not None else op.buf)
            op.ucx = None
        del ops
        worker = getattr(self, "_worker", None)
        if worker is not None:
            try:
                worker.cancel_inflight_requests()
                worker.progress()
            except Exception:
                pass
        del worker
        self._worker = None
        self._ucx = None
        self._graveyard.clear()
        if self._wake_fd >= 0:
            os.close(self._wake_fd)
            self._wake_fd = -1
