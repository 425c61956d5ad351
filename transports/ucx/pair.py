"""`UcxPair`: the endpoint to one peer, its requests (eager or with a separate payload tag,
host or device memory), connecting through the peer's published worker address, and the pair's
abort, loss and close.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from itertools import count
from typing import TYPE_CHECKING, Any

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES, DeviceView, Pair, Request
from ddlcore.transports.common import (
    MAX_CHECK,
    Matcher,
    abort_error,
    as_view,
    check_tag,
    recv_view,
    seconds,
    timeout_error,
)
from ddlcore.transports.pairs import LazyPair, MatchedPair
from ddlcore.transports.ucx.protocol import (
    _ABORT,
    _CLOSE,
    _CTRL_KIND,
    _DATA,
    _DATA_APART,
    _EAGER_BYTES,
    _FRAME,
    _HEADER,
    _NONCE_BYTES,
    _TOKEN_BYTES,
    PROTOCOL_VERSION,
    Control,
    Part,
    UcxRequest,
    _payload_tag,
    _ucx_tag,
)

from ddlcore.errors import (
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
    StoreUnreachableError,
)

if TYPE_CHECKING:
    from ddlcore.transports.ucx.context import UcxContext


class UcxPair(MatchedPair, LazyPair, Pair):
    """The endpoint to one peer and the matching state of the messages from it."""

    _ctx: UcxContext

    def __init__(self, ctx: UcxContext, peer: int) -> None:
        self.rank, self.peer = ctx.rank, peer
        self._ctx = ctx
        self._ep: Any = None  # set once by _connect
        # Receives and messages by tag; failure (abort, close) and lost (the peer closed, died)
        self._matcher: Matcher[UcxRequest] = Matcher(ctx.rank, peer, "UCX")
        self._abort_lock = threading.Lock()  # guards the abort frame and whether it went out
        self._init_connect()
        self._connected = False  # _connect ran: the endpoint exists, or the pair is lost
        self._abort_frame: bytes | None = None  # header and reason; the token goes on at sending
        self._abort_sent = False
        self._in_token = ctx._token(peer, ctx.rank, ctx._nonce)  # what the peer's messages carry
        self._out_token = b""  # what ours carry: known once the peer's nonce is (_connect)
        self._heard = False  # any control message arrived from the peer
        self._msgno = count()
        self._ctrl: deque[Control] = deque()  # progress thread only
        self._ctrl_tag = ctx._lib.UCXXTag(_ucx_tag(_CTRL_KIND, ctx.rank, 0))
        self.device_memory = ctx.device_memory

    # --- requests -------------------------------------------------------------------------------
    def isend(self, view: memoryview | DeviceView, tag: int, check: int = 0) -> Request:
        on_device = isinstance(view, DeviceView)
        if isinstance(view, DeviceView):
            view = self._device_view(view)
        else:
            view = as_view(view)
        check_tag(tag, check)
        req = UcxRequest(self, view, tag, check, True)
        ep = self._ep
        if self._failure is not None or self._lost is not None or ep is None:
            req._fail(self._error_for(req))
            return req
        nbytes = req.nbytes
        msgno = next(self._msgno)
        token = self._out_token
        lib, Array = self._ctx._lib, self._ctx._Array
        parts: list[Part] = []
        try:
            if nbytes <= _EAGER_BYTES and not (on_device and nbytes):
                frame = bytearray(_FRAME + nbytes)
                frame[:_TOKEN_BYTES] = token
                _HEADER.pack_into(
                    frame, _TOKEN_BYTES, _DATA, PROTOCOL_VERSION, check, tag, nbytes, 0
                )
                if nbytes:
                    assert isinstance(view, memoryview)  # a device payload travels apart
                    frame[_FRAME:] = view
                parts.append(Part(ep.tag_send(Array(frame), self._ctrl_tag), frame))
            else:
                kind = _DATA_APART if on_device else _DATA
                header = token + _HEADER.pack(kind, PROTOCOL_VERSION, check, tag, nbytes, msgno)
                parts.append(Part(ep.tag_send(Array(header), self._ctrl_tag), header))
                payload_tag = lib.UCXXTag(_payload_tag(token, msgno))
                parts.append(Part(ep.tag_send(Array(view), payload_tag), view))
        except Exception as exc:  # UCX refused a send outright: the endpoint is unusable
            self._broken(exc)
            req._fail(self._error_for(req))  # a part already issued is still watched below
        self._ctx._track_send(self, req, parts)
        return req

    def _device_view(self, view: DeviceView) -> DeviceView:
        if not self.device_memory:
            raise ValueError(
                f"rank {self.rank}: this UCX has no CUDA support (its context lists "
                "no CUDA memory type); device memory must be staged through host "
                "memory (DDL_GPU_DIRECT=off/auto does that)"
            )
        self._ctx._bind_device(view)
        return view

    def irecv(self, view: memoryview | DeviceView, tag: int, check: int = 0) -> Request:
        if isinstance(view, DeviceView):
            check_tag(tag, check)
            view = self._device_view(view)
        else:
            view = recv_view(view, tag, check)
        req = UcxRequest(self, view, tag, check, False)
        self._matcher.post(req)
        return req

    def _timeout_error(self, req: UcxRequest, timeout: float) -> DDLTimeoutError:
        note = " (UCX)"
        if not req.is_send and not self._heard:
            note += f"; nothing has arrived from rank {self.peer} yet"
        return timeout_error(self.rank, self.peer, req, timeout, note)

    # --- connection -----------------------------------------------------------------------------
    def _open(self, deadline: float) -> None:
        """Create the endpoint to the peer (`LazyPair._connect`: once). A peer whose address
        cannot be had is an error, kept and raised again; a peer UCX cannot reach makes the pair
        lost instead: the peer may have finished and exited, and what it sent before must stay
        receivable."""
        raw = self._peer_address(deadline)
        ctx = self._ctx
        if self._lost is not None:  # it said goodbye already: nothing to connect to
            return
        if len(raw) <= _NONCE_BYTES:
            raise RendezvousError(
                f"rank {self.rank}: the UCX address rank {self.peer} "
                f"published is {len(raw)} bytes: it runs another "
                "ddlcore; run the same one on every rank"
            )
        self._out_token = ctx._token(self.rank, self.peer, raw[:_NONCE_BYTES])
        try:
            address = ctx._lib.UCXAddress.create_from_buffer(raw[_NONCE_BYTES:])
            ep = ctx._worker.create_endpoint_from_worker_address(address, True)
        except Exception as exc:
            self._lose(
                f"rank {self.rank} cannot reach rank {self.peer} over UCX ({exc}): rank "
                f"{self.peer} has exited, or no UCX transport with a peer-failure handler "
                "links the two (posix/sysv shared memory alone has none: check UCX_TLS and "
                "UCX_NET_DEVICES; ucx_info -d lists what UCX sees);"
            )
            return
        self._attach(ep)

    def _peer_address(self, deadline: float) -> bytes:
        ctx, peer = self._ctx, self.peer
        key = f"ucx/addr/{peer}"
        wait_s = max(0.0, deadline - time.monotonic())
        try:
            raw = ctx.store.get(key, wait_s)
        except StoreUnreachableError as exc:  # rank 0, which serves the store, is gone
            raise PeerFailureError(
                f"rank {self.rank} could not look up the UCX worker address of rank {peer}: {exc}",
                0,
            ) from None
        except RendezvousError:
            raise DDLTimeoutError(
                f"rank {self.rank} waited {seconds(wait_s)} s for the UCX worker address of rank "
                f"{peer} (store key {key!r}): rank {peer} has not created its UCX context; it has "
                "not started, is stuck, failed, or runs another DDL_TRANSPORT"
            ) from None
        return raw

    def _attach(self, ep: Any) -> None:
        ctx = self._ctx
        with ctx._lock:
            closed = ctx._closed
            if not closed:
                ep.set_close_callback(ctx._on_endpoint_closed, (self.peer,))
                self._ep = ep
        if closed:
            ep.close_blocking()
            raise CommunicatorClosedError(
                f"rank {self.rank}: the UCX context was closed while connecting to rank {self.peer}"
            )
        if not ep.alive:  # failed before the callback was in place
            ctx._on_endpoint_closed(self.peer)
        with self._abort_lock:
            frame = self._abort_frame if not self._abort_sent else None
            self._abort_sent = self._abort_frame is not None
        if frame is not None:  # we aborted before connecting: tell the peer now
            ctx._send_ctrl(self, frame)

    # --- failure and shutdown -------------------------------------------------------------------
    def _fail_pair(self, error: DDLError) -> None:
        """Fail every pending and later request (first error wins)."""
        if self._matcher.fail(error):
            self._ctx._wake()  # in-flight operations of this pair: failed by the progress thread

    def _lose(self, text: str) -> None:
        """The peer closed or died: fail pending receives and every later request that no fully
        arrived message satisfies."""
        if self._matcher.lose(text):
            self._ctx._wake()

    def _broken(self, why: object) -> None:
        self._lose(f"connection to rank {self.peer} lost (UCX: {why});")

    def abort(self, code: int, reason: str) -> None:
        raw = reason.encode("utf-8", "replace")[:MAX_ABORT_REASON_BYTES]
        frame = _HEADER.pack(_ABORT, PROTOCOL_VERSION, code & MAX_CHECK, 0, len(raw), 0) + raw
        with self._abort_lock:
            if self._abort_frame is not None:
                return
            self._abort_frame = frame
            send = self._ep is not None and not self._ctx._closed
            self._abort_sent = send
        if send:
            self._ctx._send_ctrl(self, frame)
        self._fail_pair(abort_error(code, self.rank, reason, self.peer))

    def close(self) -> None:
        """Fail this pair's requests and tell the peer; the endpoint itself is released with the
        context (closing it here would race the progress thread)."""
        self._goodbye()

    def _goodbye(self) -> Any:
        """`close`, returning the UCX request of the CLOSE notice (None when none was sent)."""
        sent = None
        if self._failure is None and self._ep is not None and self._lost is None:
            sent = self._ctx._send_ctrl(self, _HEADER.pack(_CLOSE, PROTOCOL_VERSION, 0, 0, 0, 0))
        self._fail_pair(
            CommunicatorClosedError(
                f"rank {self.rank} closed its UCX connection to rank {self.peer} while the request "
                "was pending"
            )
        )
        return sent
