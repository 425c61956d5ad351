"""UCX transport (ucxx): tag-matched, non-blocking point-to-point messages over whatever UCX finds
(InfiniBand/RoCE verbs, TCP, ...), through ucxx's synchronous layer ``ucxx._lib.libucxx``.

Shape (as tcp.py): `UcxTransport` -> `UcxContext` (this rank's UCX context, worker and progress
thread) -> `UcxPair` (one endpoint to one peer) -> `UcxRequest`. This file is over the ~500-line
guide because the wire protocol, the progress thread and the failure rules only make sense
together.

Endpoints: each context publishes a fresh nonce and its worker address under the store key
``ucx/addr/{rank}`` when it is created; ``pair(p)`` reads ``p``'s (published at ``p``'s init, so
this waits for the peer's init at most, never for its program to reach the pair) and creates an
endpoint with peer error handling. UCX connects in the background; sends queue in UCX until it
is up.

Trust: UCX accepts any endpoint that reaches the worker, and its tag matching is per worker, not
per endpoint, so a handshake on an endpoint would vouch for nothing received later. Instead
every control message starts with the token of its pair, ``token(s -> d)`` = the first 16 bytes
of ``HMAC(job key, "ucx token" | nonce_d | s | d)`` (`JobKey.derive`; nonce_d is the
receiver's, fresh per context, and reaches peers only through the authenticated store). A
control message whose token is not that of the source rank in its UCX tag is dropped unread
(counted in `UcxContext.forged`, logged with ``DDL_DEBUG=1``), whatever it says. A payload's
tag is not guessable either: its 60 low bits are a keyed hash (BLAKE2b, keyed with the pair's
token) of the message number, so a stranger cannot slip a payload in ahead of the real one.
Payloads themselves are not authenticated: an attacker on the network path is out of scope, as
for tcp. Nor is UCX's memory bounded against strangers: messages on tags nobody receives stay
in UCX's unexpected queue until the context closes.

Wire: UCX's tag receive matches per worker, not per endpoint, so every control tag names its
source rank: ``kind (4 bits) | source rank (28) | 0 (32)``. A message is a control message
on ``(CTRL, src, 0)``: the pair's token (16 bytes), a fixed header (little endian, 32 bytes:
kind u16 | version u16 | check u32 | tag u64 | nbytes u64 | msgno u64) and, up to
_EAGER_BYTES, the payload itself; a larger payload travels separately on the unique tag
``(PAYLOAD, keyed hash of msgno)`` (msgno counts the sender's messages to that peer). ABORT carries an ``ABORT_*`` code in ``check`` and a
UTF-8 reason of at most MAX_ABORT_REASON_BYTES; CLOSE says the sender closed its context.

Matching happens in Python, on this context's progress thread: it probes control messages from
any source (in order per source, as UCX keeps them), matches each against the receives posted
for its 64-bit tag (exact size, check word), and posts the payload's UCX receive straight into
the user's buffer (no copy), or into a new buffer when no receive is posted yet (copied out
when one is). So a send completes without waiting for the receiver's program.

Progress: one Python thread per context drives ``worker.progress()`` and sleeps in ``poll``
on the worker's event fd (UCX blocking mode) plus an eventfd that other threads use to wake it;
waits block on a lock the thread releases, always with a deadline.

Failures: endpoints use UCX peer error handling (a dead peer's sockets or UCX keepalive make
UCX call our close callback), which fails the pair's pending and later requests with
`PeerFailureError`; fully arrived messages stay receivable. ABORT and local close fail
everything on the pair at once (an ABORT received, the whole context), as in tcp.py. UCX
1.21's shared-memory transports (posix, sysv) have no peer-failure handler, so with error
handling UCX carries same-host traffic over tcp (loopback); ddlcore's own shm transport is the
fast path within a host.

UCX configuration: UCX reads its ``UCX_*`` variables from the environment, and those always win.
Our defaults (_UCX_DEFAULTS) go in the context's config only for names the user has not set.
One exception, rails: when ``UCX_NET_DEVICES`` lists several devices, local rank i's context
gets the (i mod A)-th of them alone (as tcp's ``DDL_SOCKET_IFNAME``), so a host's ranks spread
over its adapters instead of all picking UCX's favourite.
ucxx's package ``__init__`` writes a few ``UCX_*`` defaults into ``os.environ`` when first
imported; we import it lazily and put the environment back as it was (see `_import_ucxx`).

MPI beside UCX: the MPICH wheel bundles its own libucs; ucxx's UCX cannot load into a process
that already runs it, so under ``mpiexec`` with ``auto`` the MPI transport is readied first and
ucx reports itself unavailable, saying why (`_foreign_ucx`).

Device memory: when UCX reports CUDA support (``ucp_context_query`` lists the CUDA memory
type: `cuda_memory`) or ``DDL_GPU_DIRECT=on``, pairs take `DeviceView`s: ucxx's ``Array`` reads
their ``__cuda_array_interface__`` and UCX moves the bytes with cuda_copy / cuda_ipc / GPUDirect
RDMA (it finds the memory type from the pointer). The progress thread, which posts receives
into device memory and drives UCX's CUDA copies, first makes the views' GPU current on itself
(`DeviceView.bind`), as UCX's CUDA transports need a current context. A device payload always travels on its own tag
(``DATA_APART``), never inside the header message, so Python never touches device bytes on the
send side; a message that arrived in host memory before its device receive was posted is copied
up with `DeviceView.upload`.
``DDL_NCHANNELS`` does not apply: UCX spreads over rails itself.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import logging
import os
import secrets
import select
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from itertools import count
from typing import Any, NamedTuple

from ddlcore.transports.base import (
    MAX_ABORT_REASON_BYTES,
    Context,
    DeviceView,
    Pair,
    PeerInfo,
    Request,
    Store,
    Transport,
)
from ddlcore.transports.common import (
    MAX_CHECK,
    Matcher,
    Message,
    ThreadRequest,
    abort_error,
    as_view,
    check_tag,
    copy_error,
    job_key_of,
    loaded_libraries,
    recv_view,
    seconds,
    timeout_error,
)
from ddlcore.transports.pairs import LazyPair, MatchedPair, PairTableContext

from ddlcore import config
from ddlcore.errors import (
    CommunicatorClosedError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
)
from ddlcore.store import StoreUnreachableError

# 2: DATA_APART (device payloads of any size travel on their own tag); 3: tokens, keyed tags
PROTOCOL_VERSION = 3
_HEADER = struct.Struct("<HHIQQQ")  # kind, version, check, tag, nbytes, msgno
_TOKEN_BYTES = 16  # before the header: the pair's token (see Trust in the module docstring)
_NONCE_BYTES = 16  # a context's nonce, published before its worker address
_TOKEN_LABEL = b"ucx token"
_PAYLOAD_BITS = (1 << 60) - 1
_DATA, _ABORT, _CLOSE, _DATA_APART = 1, 2, 3, 4
_CTRL_KIND, _PAYLOAD_KIND = 1, 2
_KIND_SHIFT, _SRC_SHIFT = 60, 32
_MAX_RANKS = 1 << 28  # the source rank's field in a UCX tag
# Payloads up to this size ride inside the header message: one UCX message instead of two and no
# Python round trip before the payload's receive is posted. Kept under UCX's default rendezvous
# threshold (8 KB) so a header message never needs a rendezvous handshake.
_EAGER_BYTES = 4096
_FRAME = _TOKEN_BYTES + _HEADER.size  # a control message's bytes before its body
_MAX_CTRL_BYTES = _FRAME + max(_EAGER_BYTES, MAX_ABORT_REASON_BYTES)
_IDLE_WAIT_MS = 100  # the progress thread's longest sleep; UCX keepalive runs from progress
_PROBES_PER_ROUND = 256  # control messages taken per round, so completions are not starved
_GOODBYE_TIMEOUT_S = 0.5  # how long close() lets CLOSE notices leave before closing endpoints
_JOIN_TIMEOUT_S = 5.0
# What an in-flight UCX operation is: part of a send; a payload into the posted buffer; a payload
# into a Message; a payload or stray control message taken only to be dropped; a notice sent.
_OP_SEND, _OP_RECV, _OP_TEMP, _OP_DRAIN, _OP_NOTICE = 0, 1, 2, 3, 4

# Our defaults for the UCX context, each used only when the user has not set UCX_<NAME>.
# KEEPALIVE_INTERVAL: UCX's default (20 s) lets a silently dead peer (host down, cable pulled)
# go unnoticed for that long on transports where no socket breaks; 1 s costs a few bytes per
# endpoint per second.
_UCX_DEFAULTS = {"KEEPALIVE_INTERVAL": "1s"}

# ucp_context_query: the field_mask bit asking for memory types, the 64-bit word that holds them
# in ucp_context_attr_t (after field_mask, request_size and the padded thread_mode), and CUDA's
# bit in them (ucs_memory_type_t); ucp.h and memory_type.h of UCX 1.x.
_UCP_ATTR_FIELD_MEMORY_TYPES = 1 << 2
_MEMORY_TYPES_WORD = 3
_UCS_MEMORY_TYPE_CUDA = 1

_import_lock = threading.Lock()
_log = logging.getLogger("ddlcore")


def _foreign_ucx() -> str:
    """The path of a UCX library loaded into this process from somewhere other than the libucx
    wheel (the MPICH wheel bundles its own), or "" when there is none."""
    if "mpi4py.MPI" not in sys.modules or "ucxx" in sys.modules:
        return ""
    return next((p for p in loaded_libraries("/libucs.so") if "/libucx/" not in p), "")


def cuda_memory(ucx_context: Any) -> bool:
    """Whether a UCX context moves CUDA memory: ``UCS_MEMORY_TYPE_CUDA`` among the memory
    types ``ucp_context_query`` reports (UCX found its CUDA modules and a driver). ucxx's
    ``cuda_support`` only reads UCX_TLS, and says yes on a machine without a GPU."""
    for path in loaded_libraries("/libucp.so"):
        try:
            query = ctypes.CDLL(path).ucp_context_query
        except (OSError, AttributeError):
            continue
        attr = (ctypes.c_uint64 * 64)()  # ucp_context_attr_t, with room to spare
        attr[0] = _UCP_ATTR_FIELD_MEMORY_TYPES
        if query(ctypes.c_void_p(ucx_context.handle), attr) != 0:
            return False
        return bool(attr[_MEMORY_TYPES_WORD] & (1 << _UCS_MEMORY_TYPE_CUDA))
    return False


def _import_ucxx() -> tuple[Any, Any]:
    """``ucxx._lib.libucxx`` and ucxx's ``Array`` (its buffer wrapper), imported on first use.

    ucxx's package ``__init__`` sets UCX_MEMTYPE_CACHE, UCX_RNDV_THRESH, UCX_RNDV_FRAG_MEM_TYPE
    and UCX_MAX_RNDV_RAILS in ``os.environ`` when they are unset; UCX would then take them for
    the user's settings (and warn about the ones it no longer knows), and child processes would
    inherit them. When this import is the first of ucxx in the process, the ``UCX_*`` variables
    are put back as they were before it.
    """
    with _import_lock:
        first = "ucxx" not in sys.modules
        before = {k: v for k, v in os.environ.items() if k.startswith("UCX_")}
        try:
            from ucxx._lib import libucxx
            from ucxx._lib.arr import Array
        finally:
            if first:
                for key in [k for k in os.environ if k.startswith("UCX_") and k not in before]:
                    del os.environ[key]
                for key, value in before.items():
                    if os.environ.get(key) != value:
                        os.environ[key] = value
    return libucxx, Array


def ucx_options(environ: Mapping[str, str] | None = None, local_rank: int = 0) -> dict[str, str]:
    """The UCX config this transport passes to ``UCXContext``: our defaults, minus every name
    the user set as ``UCX_<NAME>`` (explicit environment wins; UCX reads it itself). When
    ``UCX_NET_DEVICES`` lists several devices (rails), local rank i's context takes the
    (i mod A)-th alone (`net_device_rails`)."""
    env = os.environ if environ is None else environ
    options = {k: v for k, v in _UCX_DEFAULTS.items() if f"UCX_{k}" not in env}
    rails = net_device_rails(env)
    if len(rails) > 1:
        options["NET_DEVICES"] = rails[local_rank % len(rails)]
    return options


def net_device_rails(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The network devices ``UCX_NET_DEVICES`` lists, one per rail ("mlx5_0:1,mlx5_1:1"); none
    for UCX's default ("all", or unset)."""
    env = os.environ if environ is None else environ
    names = tuple(n.strip() for n in env.get("UCX_NET_DEVICES", "").split(",") if n.strip())
    return () if names in ((), ("all",)) or "all" in names else names


def _features(lib: Any) -> tuple[Any, ...]:
    return (lib.Feature.TAG, lib.Feature.WAKEUP)


def _ucx_tag(kind: int, src: int, low: int) -> int:
    return (kind << _KIND_SHIFT) | (src << _SRC_SHIFT) | low


def _payload_tag(token: bytes, msgno: int) -> int:
    """The UCX tag of payload ``msgno`` of the pair whose token is ``token``: unguessable
    without the token, and distinct per message (60 bits of a keyed hash)."""
    digest = hashlib.blake2b(msgno.to_bytes(8, "little"), digest_size=8, key=token).digest()
    return (_PAYLOAD_KIND << _KIND_SHIFT) | (int.from_bytes(digest, "little") & _PAYLOAD_BITS)


class UcxRequest(ThreadRequest):
    """A pending send or receive (completed by the progress thread, waited on through a lock),
    plus the number of UCX operations a send still waits for."""

    __slots__ = ("_parts",)
    _parts: int  # set by UcxContext._track_send before the progress thread sees the request


class _Part(NamedTuple):
    """A UCX send a request waits for, and the buffer it reads (kept alive until it is done)."""

    ucx: Any
    buf: Any


class _Control(NamedTuple):
    """A control message UCX is receiving for a pair (handled in order once complete): the UCX
    request, its buffer, and the length the sender sent (the buffer may be cut at the cap)."""

    ucx: Any
    buf: bytearray
    length: int


class _Op:
    """A UCX operation in flight, watched by the progress thread. The buffer UCX reads or writes
    is referenced here until UCX says it is finished with it."""

    __slots__ = ("ucx", "pair", "kind", "req", "msg", "buf")

    def __init__(self, ucx: Any, pair: UcxPair | None, kind: int, req: UcxRequest | None = None,
                 msg: Message | None = None, buf: Any = None) -> None:
        self.ucx, self.pair, self.kind, self.req, self.msg, self.buf = ucx, pair, kind, req, msg, buf


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
        self._ctrl: deque[_Control] = deque()  # progress thread only
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
        parts: list[_Part] = []
        try:
            if nbytes <= _EAGER_BYTES and not (on_device and nbytes):
                frame = bytearray(_FRAME + nbytes)
                frame[:_TOKEN_BYTES] = token
                _HEADER.pack_into(frame, _TOKEN_BYTES, _DATA, PROTOCOL_VERSION, check, tag,
                                  nbytes, 0)
                if nbytes:
                    assert isinstance(view, memoryview)  # a device payload travels apart
                    frame[_FRAME:] = view
                parts.append(_Part(ep.tag_send(Array(frame), self._ctrl_tag), frame))
            else:
                kind = _DATA_APART if on_device else _DATA
                header = token + _HEADER.pack(kind, PROTOCOL_VERSION, check, tag, nbytes, msgno)
                parts.append(_Part(ep.tag_send(Array(header), self._ctrl_tag), header))
                payload_tag = lib.UCXXTag(_payload_tag(token, msgno))
                parts.append(_Part(ep.tag_send(Array(view), payload_tag), view))
        except Exception as exc:  # UCX refused a send outright: the endpoint is unusable
            self._broken(exc)
            req._fail(self._error_for(req))  # a part already issued is still watched below
        self._ctx._track_send(self, req, parts)
        return req

    def _device_view(self, view: DeviceView) -> DeviceView:
        if not self.device_memory:
            raise ValueError(f"rank {self.rank}: this UCX has no CUDA support (its context lists "
                             "no CUDA memory type); device memory must be staged through host "
                             "memory (DDL_GPU_DIRECT=off/auto does that)")
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

    def _error_for(self, req: UcxRequest) -> DDLError:
        return self._matcher.error_for(req)

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
            raise RendezvousError(f"rank {self.rank}: the UCX address rank {self.peer} "
                                  f"published is {len(raw)} bytes: it runs another "
                                  "ddlcore; run the same one on every rank")
        self._out_token = ctx._token(self.rank, self.peer, raw[:_NONCE_BYTES])
        try:
            address = ctx._lib.UCXAddress.create_from_buffer(raw[_NONCE_BYTES:])
            ep = ctx._worker.create_endpoint_from_worker_address(address, True)
        except Exception as exc:
            self._lose(
                f"rank {self.rank} cannot reach rank {self.peer} over UCX ({exc}): rank "
                f"{self.peer} has exited, or no UCX transport with a peer-failure handler "
                "links the two (posix/sysv shared memory alone has none: check UCX_TLS and "
                "UCX_NET_DEVICES; ucx_info -d lists what UCX sees);")
            return
        self._attach(ep)

    def _peer_address(self, deadline: float) -> bytes:
        ctx, peer = self._ctx, self.peer
        key = f"ucx/addr/{peer}"
        wait_s = max(0.0, deadline - time.monotonic())
        try:
            raw = ctx.store.get(key, wait_s)
        except StoreUnreachableError as exc:  # rank 0, which serves the store, is gone
            raise PeerFailureError(f"rank {self.rank} could not look up the UCX worker address "
                                   f"of rank {peer}: {exc}", 0) from None
        except RendezvousError:
            raise DDLTimeoutError(
                f"rank {self.rank} waited {seconds(wait_s)} s for the UCX worker address of rank "
                f"{peer} (store key {key!r}): rank {peer} has not created its UCX context; it has "
                "not started, is stuck, failed, or runs another DDL_TRANSPORT") from None
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
            raise CommunicatorClosedError(f"rank {self.rank}: the UCX context was closed while "
                                          f"connecting to rank {self.peer}")
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
            sent = self._ctx._send_ctrl(self, _HEADER.pack(_CLOSE, PROTOCOL_VERSION, 0, 0, 0,
                                                           0))
        self._fail_pair(CommunicatorClosedError(
            f"rank {self.rank} closed its UCX connection to rank {self.peer} while the request "
            "was pending"))
        return sent


class UcxContext(PairTableContext):
    """This rank's UCX context and worker, its progress thread and its pairs."""

    _label = "UCX"

    def __init__(self, rank: int, size: int, store: Store, timeout: float,
                 local_rank: int = 0) -> None:
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
        self._incoming: deque[_Op] = deque()  # operations other threads hand to the progress thread
        self._ops: list[_Op] = []  # progress thread only
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
            self.device_memory = direct == "on" or (direct == "auto" and
                                                    cuda_memory(self._ucx))
            self._worker = lib.UCXWorker(self._ucx)
            self._worker.init_blocking_progress_mode()
            self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._poller = select.poll()
            self._poller.register(self._worker.epoll_file_descriptor, select.POLLIN)
            self._poller.register(self._wake_fd, select.POLLIN)
            self._thread = threading.Thread(target=self._run, name=f"ddl-ucx-progress-{rank}",
                                            daemon=True)
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

    def _track_send(self, pair: UcxPair, req: UcxRequest, parts: list[_Part]) -> None:
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
                waiting.append(_Op(ucx_req, pair, _OP_SEND, req=req, buf=buf))
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
        self._incoming.append(_Op(ucx_req, pair, _OP_NOTICE, buf=frame))
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
            error = DDLError(f"rank {self.rank}: the UCX progress thread failed: {exc!r}; the "
                             "UCX context cannot be used any more (report this as a bug)")
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
                self._ops.append(_Op(ucx_req, None, _OP_DRAIN, buf=buf))
                continue
            pair = self._pairs.get(src) or self._pair_for(src)
            pair._ctrl.append(_Control(ucx_req, buf, length))
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
                if len(frame) < _FRAME or not hmac.compare_digest(frame[:_TOKEN_BYTES],
                                                                  pair._in_token):
                    self.forged += 1  # not from the rank its tag names: not a word is heard
                    _log.debug("rank %d dropped a UCX control message of %d bytes claiming to "
                               "be from rank %d: its token is not that rank's", self.rank,
                               length, pair.peer)
                    continue
                try:
                    if failed is not None:
                        raise failed
                    if length > _MAX_CTRL_BYTES:
                        raise ValueError(f"a control message of {length} bytes (cap "
                                         f"{_MAX_CTRL_BYTES})")
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
            raise ValueError(f"rank {pair.peer} speaks UCX protocol {version}, ours is "
                             f"{PROTOCOL_VERSION}: run the same ddlcore on every rank")
        pair._heard = True
        body = frame[_HEADER.size:]
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

    def _on_data(self, pair: UcxPair, check: int, tag: int, nbytes: int, msgno: int,
                 eager: memoryview | None) -> None:
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
            self._post_payload(pair, msgno, req.view, _Op(None, pair, _OP_RECV, req=req))
        elif queued:  # nobody asked yet: receive it now, so the sender is not held up
            msg.data = bytearray(nbytes)
            self._post_payload(pair, msgno, msg.data, _Op(None, pair, _OP_TEMP, msg=msg))
        else:  # a mismatch, or a pair that failed: take the payload and drop it
            scratch = bytearray(nbytes)
            self._post_payload(pair, msgno, scratch, _Op(None, pair, _OP_DRAIN, buf=scratch))

    def _post_payload(self, pair: UcxPair, msgno: int, target: Any, op: _Op) -> None:
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

    def _finish(self, op: _Op) -> None:
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

    def _abandon(self, op: _Op) -> None:
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


class UcxTransport(Transport):
    """UCX through ucxx: InfiniBand, RoCE, TCP (and, later, GPU memory) across hosts."""

    name = "ucx"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        clash = _foreign_ucx()
        if clash:
            return False, (f"this process already runs MPI with its own UCX ({clash}); ucxx's "
                           "UCX cannot load beside it. Use DDL_TRANSPORT=mpi under mpiexec, or "
                           "start the job with ddlrun/torchrun for ucx")
        try:
            lib, _ = _import_ucxx()
        except ImportError as exc:
            import importlib.util

            reason = (f"ucxx is not installed ({exc}); pip install 'ddlcore[ucx]' (the ucxx-cu12 "
                      "wheel brings UCX itself)")
            if importlib.util.find_spec("ucp") is not None:
                reason += ("; ucx-py (ucp) is installed but not supported: its synchronous layer "
                           "differs from ucxx's, and ucxx is its maintained successor")
            return False, reason
        except Exception as exc:  # e.g. libucx fails to load
            return False, f"ucxx failed to import: {exc!r}; reinstall ucxx-cu12 / libucx-cu12"
        try:
            lib.UCXContext(ucx_options(), _features(lib))
        except Exception as exc:
            return False, (f"UCX cannot create a context here: {exc}; check the UCX_* variables "
                           "(UCX_TLS, UCX_NET_DEVICES; ucx_info -d lists the devices UCX sees)")
        return True, ""

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return True

    def create_context(self, rank: int, size: int, store: Store, timeout: float) -> Context:
        return UcxContext(rank, size, store, timeout)

    def create_context_local(self, rank: int, size: int, store: Store, timeout: float,
                             local_rank: int) -> Context:
        return UcxContext(rank, size, store, timeout, local_rank)
