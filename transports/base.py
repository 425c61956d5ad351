"""The transport interface: point-to-point, tag-matched, non-blocking send/recv between two ranks.

Shaped after Gloo's transport layer:

* `Transport` -- a backend (tcp, shm, mpi, ucx). Says whether it can run here (`is_available`)
  and whether it can link two given ranks (`can_connect`), and creates contexts.
* `Context`   -- the peers of one communicator as seen by this rank; hands out `Pair` objects,
  connecting lazily on first use through the rendezvous `Store`.
* `Pair`      -- one connection to one peer: `isend` / `irecv` of a byte range with a 64-bit tag.
* `Request`   -- an outstanding operation: `wait(timeout)` or `test()`.

Semantics every transport keeps (the conformance suite in ``tests/transports`` checks them):

* `Context.pair`, `Pair.isend` and `Pair.irecv` never wait for the peer's program: a pair is
  usable at once, and sends queue until the connection is up. (Waiting in ``pair()`` for the
  peer to connect deadlocks when ranks reach each other in different orders.)
* Tags are unsigned 64-bit, check words unsigned 32-bit; values out of range are a ValueError.
* Messages between two ranks with the same tag are received in the order they were sent.
  A receive matches the oldest unmatched message with its tag, whether the message arrived
  before or after the receive was posted.
* The receive buffer must have exactly the message's size, and a receive posted with a nonzero
  ``check`` word must meet a message sent with the same word; otherwise the receive fails with
  `CollectiveMismatchError` (that is how ranks calling different collectives are caught cheaply).
  Transports whose wire format has no room for the check word may ignore it.
* Every wait has a deadline: `Request.wait` raises `DDLTimeoutError` naming the peer and how long
  it waited; the request stays posted and may be waited on again. A peer that closes, resets or
  dies fails every pending and later receive that no fully arrived message satisfies, with
  `PeerFailureError` naming the peer rank (messages that arrived before its goodbye are still
  delivered). `Pair.abort` tells the peer why we stopped; the peer's requests then fail at once
  with the same error class and reason. Requests pending at a local ``close()`` fail with
  `CommunicatorClosedError`.
* An abort heard from one peer is the whole communicator's: the context that hears it aborts
  itself once, as `Context.abort` would, with the same class, origin and cause (every pair
  fails, and the peers still waiting on us hear of it), then calls ``Context.on_abort(code,
  reason)`` when set, with which the communicator aborts its other contexts. So every rank
  hears of a failure within a few message latencies, also one blocked on a peer that never
  heard of it directly. A context that does neither still works (API_VERSION 1): its peers'
  aborts then reach its other pairs only when the communicator fails a collective.
* Nothing received is unpickled: control data is fixed binary headers with length caps.
* Only the job's ranks are heard: a transport that accepts connections or messages from the
  network acts on nothing from a sender that has not proven the job's key (``store.job_key``),
  and a stranger's connection or message is dropped without failing anything of the job's.
* Device memory: a pair whose ``device_memory`` is true also takes a `DeviceView` (GPU memory)
  wherever a view is asked for, and moves it without host staging (UCX's CUDA transports,
  CUDA-aware MPI). The other pairs take host memory only; the engines stage device buffers
  through pinned host memory for them. A message sent from device memory may be received into
  host memory and the reverse: the bytes are the same.

Options reach a transport as a value, `TransportOptions` (as gloo's ``transport::tcp::attr``
reaches ``CreateDevice``): ``ddlcore.job.links`` builds them once from the configuration (the
mapping given to ``ddlcore.init(environ=...)``, else ``os.environ``) and passes them to
`Transport.is_available` and `Transport.create_context`; no transport reads the environment.
A caller that passes none (a test, a benchmark) gets `TransportOptions.from_environ`'s.

A context may offer collectives among the ranks of one host as a whole (shm's boards):
`Context.host_collectives` returns what creates them, None where the transport has none. The
communicator asks for it instead of knowing which transport has them.

``API_VERSION`` is checked when a transport is loaded from the ``ddlcore.transports`` entry-point
group. Version 2 passes `TransportOptions` to ``is_available`` and ``create_context`` (version 1
took none, and the local rank through ``create_context_local``): a version-1 plug-in is still
loaded and called the old way (``ddlcore.transports.is_available`` / ``create_context``), any
other version is refused with a message saying so.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ddlcore.security.auth import JobKey

API_VERSION = 2
# The versions `ddlcore.transports.load` accepts: 1 is called without options (see above).
SUPPORTED_API_VERSIONS = (1, 2)

# The columns of the step rows `Context.run_steps` takes (``ddlcore.algorithms.schedule.StepTable``).
STEP_COLUMNS = ("kind", "peer", "slot", "count", "src", "src_off", "dst", "dst_off", "flags")

# Error codes carried by an abort message, so the peer raises the same class we did.
ABORT_PEER_FAILURE = 0
ABORT_MISMATCH = 1
ABORT_TIMEOUT = 2
ABORT_OTHER = 3
ABORT_REVOKED = 4  # a rank revoked the communicator (`Communicator.revoke`); a peer that does
# not know the code raises PeerFailureError, as for any code it does not know

MAX_ABORT_REASON_BYTES = 4096


class Store(Protocol):
    """The rendezvous key-value store as transports see it (see ``ddlcore.job.store``)."""

    host: str  # the master's address: transports find their outgoing interface from it
    # The job's key (`ddlcore.security.auth.JobKey`): a transport that opens its own connections (tcp,
    # ucx) proves it on each one; with None they refuse to start (`common.job_key_of`).
    job_key: JobKey | None

    def set(self, key: str, value: bytes) -> None: ...

    def get(self, key: str, timeout: float | None = None) -> bytes: ...

    def add(self, key: str, amount: int) -> int: ...


@dataclass(frozen=True)
class PeerInfo:
    """What one rank knows of another when choosing a transport for the pair."""

    rank: int
    host_id: str
    transports: tuple[str, ...] = ()  # transports available in that rank's process


@dataclass(frozen=True)
class TransportOptions:
    """What a transport is told of the configuration (``ddlcore.job.links.transport_options``
    builds it from ``ddlcore.config``; the defaults are the variables' defaults)."""

    nchannels: int = 1  # DDL_NCHANNELS: TCP connections per pair
    socket_ifname: str = ""  # DDL_SOCKET_IFNAME: interface(s), one per rail ("eth0,eth1")
    gpu_direct: str = "auto"  # DDL_GPU_DIRECT: "auto", "on" or "off"
    local_rank: int = 0  # this rank's index on its host: picks its rail
    mpi_launched: bool = False  # an MPI launcher's rank variable is set (PMI_RANK, ...)
    # The UCX_* variables of the configuration's environment. UCX reads its settings from the
    # process environment itself; the UCX transport consults these only to leave the user's
    # settings alone and to pick a rail (``ucx.options.ucx_options``).
    ucx_environ: Mapping[str, str] = field(default_factory=dict, hash=False)

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, local_rank: int = 0
    ) -> TransportOptions:
        """The options of ``environ`` (``os.environ`` when None), for ``local_rank``."""
        import os

        from ddlcore import config

        env = os.environ if environ is None else environ
        return cls(
            nchannels=config.get("DDL_NCHANNELS", env),
            socket_ifname=config.get("DDL_SOCKET_IFNAME", env),
            gpu_direct=config.get("DDL_GPU_DIRECT", env),
            local_rank=local_rank,
            mpi_launched=any(config.is_set(v, env) for v in config.MPI_RANK_VARS),
            ucx_environ={k: v for k, v in env.items() if k.startswith("UCX_")},
        )


def options_or_default(options: TransportOptions | None) -> TransportOptions:
    """``options``, or the process environment's for a caller that passed none."""
    return TransportOptions.from_environ() if options is None else options


class HostCollectivesFactory(Protocol):
    """What `Context.host_collectives` returns: called on each rank of one host's group (its
    index ``rank`` of ``size``; ``group`` names the group apart from other hosts', ``ranks``
    are the members' ranks in the communicator), it makes that rank's end; the caller then
    calls ``connect(store)`` on it (collective). ``max_ranks``: the largest group it takes."""

    @property
    def max_ranks(self) -> int: ...

    def __call__(
        self,
        rank: int,
        size: int,
        store: Any,
        timeout: float,
        group: str = "",
        ranks: Sequence[int] | None = None,
    ) -> Any: ...


class DeviceView:
    """GPU memory handed to a pair whose ``device_memory`` is true: its address, its length and
    its device, exposed as ``__cuda_array_interface__`` (what UCX and mpi4py take).

    The caller guarantees that no GPU work is still writing the bytes of a send when it is
    posted, and none touches a receive's bytes until the request completed. ``upload`` copies
    host bytes into the view synchronously; a transport uses it when a message arrived in host
    memory before its device receive was posted (it may be called from any thread). ``bind``
    makes the view's GPU current on the calling thread: a transport's own thread that hands
    device memory to a library needing a current CUDA context (UCX's progress) calls it first.
    """

    __slots__ = ("ptr", "nbytes", "device", "_upload", "_bind")

    def __init__(
        self,
        ptr: int,
        nbytes: int,
        device: int,
        upload: Callable[[DeviceView, memoryview], None],
        bind: Callable[[], None] | None = None,
    ) -> None:
        if nbytes < 0 or (nbytes and not ptr):
            raise ValueError(f"a device view of {nbytes} bytes at {ptr:#x}")
        self.ptr, self.nbytes, self.device, self._upload = ptr, nbytes, device, upload
        self._bind = bind

    def __len__(self) -> int:
        return self.nbytes

    def __repr__(self) -> str:
        return f"DeviceView({self.nbytes} bytes at {self.ptr:#x} on GPU {self.device})"

    @property
    def __cuda_array_interface__(self) -> dict:
        return {
            "shape": (self.nbytes,),
            "typestr": "|u1",
            "data": (self.ptr, False),
            "strides": None,
            "version": 3,
            "stream": None,
        }

    def upload(self, data: memoryview) -> None:
        """Copy ``data`` (host bytes, exactly ``nbytes`` of them) into this device memory."""
        if len(data) != self.nbytes:
            raise ValueError(f"{len(data)} bytes for a device view of {self.nbytes}")
        if self.nbytes:
            self._upload(self, data)

    def bind(self) -> None:
        """Make this view's GPU current on the calling thread (nothing to do without a binder)."""
        if self._bind is not None:
            self._bind()


class Request(abc.ABC):
    """An outstanding send or receive."""

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until complete. Raises DDLTimeoutError after ``timeout`` seconds (None: forever
        is NOT allowed by callers in the library; they always pass a deadline), or the error
        that failed the request."""

    @abc.abstractmethod
    def test(self) -> bool:
        """True once complete; raises the error that failed the request, if any."""


class Pair(abc.ABC):
    """One connection between this rank and ``peer``."""

    peer: int
    device_memory: bool = False  # isend/irecv also take a DeviceView (see the module docstring)

    @abc.abstractmethod
    def isend(self, view: memoryview, tag: int, check: int = 0) -> Request:
        """Send the bytes of ``view`` (which must stay untouched until the request completes)."""

    @abc.abstractmethod
    def irecv(self, view: memoryview, tag: int, check: int = 0) -> Request:
        """Receive a message with ``tag`` into ``view`` (exactly ``len(view)`` bytes)."""

    @abc.abstractmethod
    def abort(self, code: int, reason: str) -> None:
        """Best effort: tell the peer we aborted and why; fail our own pending requests."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the connection; pending requests fail."""


class Context(abc.ABC):
    """The peers of one communicator, from this rank's side."""

    rank: int
    size: int
    # Set by the communicator's links: called (from any thread, at most once) with the code and
    # the reason to pass on after an abort a peer told us of aborted this context.
    on_abort: Callable[[int, str], None] | None = None

    @abc.abstractmethod
    def pair(self, peer: int) -> Pair:
        """The pair to ``peer``, connecting on first use (with the context's deadline)."""

    @abc.abstractmethod
    def abort(self, code: int, reason: str) -> None:
        """Abort every connected pair (see `Pair.abort`)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Close every pair and release all resources (sockets, threads, segments)."""

    def host_collectives(self) -> HostCollectivesFactory | None:
        """What makes collectives among the ranks of one host run as a whole through this
        transport (shm: its boards), or None: the transport has none (the default)."""
        return None

    def run_steps(
        self,
        rows: Any,
        max_count: int,
        tag_base: int,
        check: int,
        bufs: Any,
        staging: int,
        itemsize: int,
        dtype: int,
        op: int,
        divisor: int,
        timeout: float,
        keep: Any = None,
    ) -> tuple[int, Request | None]:
        """Run a collective's steps natively, as far as they go at once (tcp: small messages
        over its sockets), with the messages the engine would send, so that peers running
        theirs in Python meet them. ``rows``: int64 array, a step per row, columns
        `STEP_COLUMNS` (kind as the engine's: 0 send, 1 recv, 2 recv-reduce, 3 copy; flags:
        1 finalize, 2 staged first), peers all of this context; ``max_count``: its largest
        step's elements; ``tag_base``: the call's tags less the slot; ``bufs``: the buffers'
        addresses by buffer number (uint64 array); ``staging``: room for the largest
        recv-reduce; ``dtype``/``op``: kernel codes (sum for avg); ``divisor``: avg's
        finalize, 0 for none; ``keep``: what owns the buffers, held while a send of theirs is
        still going out after the return. Returns the index of the first step not done, which the
        engine then runs itself (0, the default, where the transport has no such path), and
        the request of the send before it if that send is still going out (the engine waits
        for it as for its own sends), else None."""
        return 0, None


class Transport(abc.ABC):
    """A transport backend."""

    name: str = ""
    api_version: int = API_VERSION

    @classmethod
    @abc.abstractmethod
    def is_available(cls, options: TransportOptions | None = None) -> tuple[bool, str]:
        """Whether this transport can run in this process, and if not, why (an actionable
        reason). ``options``: as `create_context`'s."""

    @classmethod
    def prepare(cls) -> None:
        """Called on every rank that can run this transport, right after ``is_available`` says
        yes and before the rendezvous store is used. For work that must not wait until after it: MPI_Init holds the GIL until every
        rank has joined, so run later on the rank that serves the store it would starve the
        store's threads while the other ranks still need them (a deadlock)."""
        return None  # most transports need nothing here

    @classmethod
    def rails(cls, options: TransportOptions) -> int:
        """How many network adapters (rails) per host this transport spreads a host's ranks
        over, as ``options`` configure it (the topology counts them): 1 unless it says more."""
        return 1

    @abc.abstractmethod
    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        """Whether this transport can link ``me`` and ``peer`` (e.g. shm: same host only)."""

    @abc.abstractmethod
    def create_context(
        self,
        rank: int,
        size: int,
        store: Store,
        timeout: float,
        options: TransportOptions | None = None,
    ) -> Context:
        """Create this rank's context. Addresses are exchanged through ``store``; ``timeout``
        bounds connection set-up; ``options`` is what the configuration says (None: the
        process environment's, `options_or_default`). A transport with several network
        adapters per host gives local rank i (``options.local_rank``) the (i mod A)-th (tcp:
        ``socket_ifname``'s list)."""

    def create_context_local(
        self, rank: int, size: int, store: Store, timeout: float, local_rank: int
    ) -> Context:
        """`create_context` with the process environment's options for local rank
        ``local_rank`` (API version 1's way to pass it; kept for callers of that version)."""
        options = TransportOptions.from_environ(local_rank=local_rank)
        return self.create_context(rank, size, store, timeout, options)
