"""`UcxContext`: this rank's UCX context and worker, its pairs, what other threads hand the
progress thread (sends to watch, notices, GPUs to bind) and shutdown. The progress thread
itself, which drives UCX, takes control messages and matches them, is `UcxProgress`
(``progress``), the class this one extends.
"""

from __future__ import annotations

import os
import secrets
import select
import struct
import threading
import time
from collections import deque
from typing import Any

from ddlcore.transports.base import DeviceView, Store, TransportOptions
from ddlcore.transports.common import job_key_of
from ddlcore.transports.ucx.options import _features, _import_ucxx, cuda_memory, ucx_options
from ddlcore.transports.ucx.pair import UcxPair
from ddlcore.transports.ucx.progress import UcxProgress
from ddlcore.transports.ucx.protocol import (
    _CTRL_KIND,
    _GOODBYE_TIMEOUT_S,
    _JOIN_TIMEOUT_S,
    _KIND_SHIFT,
    _MAX_RANKS,
    _NONCE_BYTES,
    _OP_NOTICE,
    _OP_SEND,
    _TOKEN_BYTES,
    _TOKEN_LABEL,
    Op,
    Part,
    UcxRequest,
)


class UcxContext(UcxProgress):
    """This rank's UCX context and worker, its progress thread and its pairs."""

    _label = "UCX"

    def __init__(
        self, rank: int, size: int, store: Store, timeout: float, options: TransportOptions
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
            settings = ucx_options(options.ucx_environ, options.local_rank)
            self._ucx = lib.UCXContext(settings, _features(lib))
            direct = options.gpu_direct
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

    def _on_endpoint_closed(self, peer: int) -> None:
        # Called by ucxx inside worker progress (any thread, UCX locks held): only queue it.
        self._endpoint_events.append(peer)
        self._wake()

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
