"""UCX transport (ucxx): tag-matched, non-blocking point-to-point messages over whatever UCX finds
(InfiniBand/RoCE verbs, TCP, ...), through ucxx's synchronous layer ``ucxx._lib.libucxx``.

Shape (as tcp): `UcxTransport` -> `UcxContext` (this rank's UCX context, worker and progress
thread) -> `UcxPair` (one endpoint to one peer) -> `UcxRequest`; modules ``options`` (UCX config
and import), ``protocol`` (wire format, records in flight), ``pair``, ``context``, ``progress``
(the progress thread), ``transport``.

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
everything on the pair at once (an ABORT received, the whole context), as in tcp. UCX
1.21's shared-memory transports (posix, sysv) have no peer-failure handler, so with error
handling UCX carries same-host traffic over tcp (loopback); ddlcore's own shm transport is the
fast path within a host.

UCX configuration: UCX reads its ``UCX_*`` variables from the environment, and those always win.
Our defaults (_UCX_DEFAULTS) go in the context's config only for names the user has not set.
One exception, rails: when ``UCX_NET_DEVICES`` lists several devices, local rank i's context
gets the (i mod A)-th of them alone (as tcp's ``DDL_SOCKET_IFNAME``), so a host's ranks spread
over its adapters instead of all picking UCX's favourite.
ucxx's package ``__init__`` writes a few ``UCX_*`` defaults into ``os.environ`` when first
imported; we import it lazily and put the environment back as it was (see `options._import_ucxx`).

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

from ddlcore.transports.ucx.context import UcxContext
from ddlcore.transports.ucx.options import (
    _UCX_DEFAULTS,
    _features,
    _import_ucxx,
    cuda_memory,
    net_device_rails,
    ucx_options,
)
from ddlcore.transports.ucx.pair import UcxPair
from ddlcore.transports.ucx.protocol import (
    _ABORT,
    _CLOSE,
    _CTRL_KIND,
    _DATA,
    _EAGER_BYTES,
    _HEADER,
    _KIND_SHIFT,
    _PAYLOAD_KIND,
    _TOKEN_BYTES,
    PROTOCOL_VERSION,
    UcxRequest,
    _ucx_tag,
)
from ddlcore.transports.ucx.transport import UcxTransport

__all__ = [
    "PROTOCOL_VERSION",
    "UcxContext",
    "UcxPair",
    "UcxRequest",
    "UcxTransport",
    "_ABORT",
    "_CLOSE",
    "_CTRL_KIND",
    "_DATA",
    "_EAGER_BYTES",
    "_HEADER",
    "_KIND_SHIFT",
    "_PAYLOAD_KIND",
    "_TOKEN_BYTES",
    "_UCX_DEFAULTS",
    "_features",
    "_import_ucxx",
    "_ucx_tag",
    "cuda_memory",
    "net_device_rails",
    "ucx_options",
]
