"""TCP transport: tag-matched, non-blocking point-to-point messages over sockets, any network.

Shape (after Gloo): `TcpTransport` -> `TcpContext` (this rank's listener and pairs) -> `TcpPair`
(``DDL_NCHANNELS`` sockets to one peer) -> `TcpRequest`.

Connecting is lazy: the lower rank of a pair connects to the higher rank's listener (address from
the store key ``tcp/addr/{rank}``), one socket per channel. With ``DDL_SOCKET_IFNAME`` listing A
interfaces (rails, one subnet each), local rank i listens on (and publishes) the (i mod A)-th's
address; a connection goes where the kernel routes the peer's address, so ranks of one rail
(mdring's rings across hosts) talk through their adapter, and no reply comes back on another
(no source is bound: that would break under strict reverse-path filtering). Before anything else on
a socket is acted on, the connector proves the job's key (``store.job_key``,
`ddlcore.security.auth.JobKey`) with its claim bound into the proof: protocol version, source rank,
destination rank, world size, channel and channel count. So a connection can only be the rank it claims, to the rank it meant.
Only then does the higher rank answer (ACK: accepted, or why not) and file the socket under its
pair; a second connection for a channel already connected is refused. Handshakes are served
concurrently (`HandshakeListener`): each has _HANDSHAKE_TIMEOUT_S for the whole of it, and caps
on pending ones (in all, and per source address) drop the oldest, so strangers holding
connections open delay nobody; a connector dropped that way tries again. ``pair(p)`` never
waits for the peer's program: on the higher side it returns at once, sends queue until the peer
connects, and a request that waits too long says the peer never connected (and how many
connections this rank refused, and why the last one was).

Each socket has a sender thread (queue of frames; ``sendmsg`` of header + payload view, no copy;
when the socket is idle the caller's thread sends without waiting) and a receiver thread, which
reads a header and then ``recv_into`` straight into the posted receive's buffer; a message no
receive has asked for yet is read into a new buffer and copied out when one is posted. A message
goes on socket ``tag % nchannels``, so messages with one tag stay ordered.

A thread waiting on a receive reads its socket itself (``Channel.drive``: polling it for
``_SPIN_S``, then sleeping in ``poll``) while the receiver thread stands back, parked until no
waiter has read for ``_LINGER_S``. One reader at a time: the waiter asks the receiver thread out
through an eventfd and takes over between frames. So a small message wakes nobody: handing each
one from the receiver thread to the waiter cost two thread wake-ups of tens of µs on a VM. The
frame being read is kept on the channel (`Inbound`): a waiter reads without blocking and leaves
at its deadline even half-way through a frame, and the next reader carries on from there.

A collective's small steps (messages up to 64 KB) run natively when the engine hands them over
(`Context.run_steps`, ``steps.py`` and ``_steps.pyx``): the sockets they use are leased (sends
from other threads queue, the receiver thread stays parked), each send is one ``sendmsg`` and
each receive reads its frame straight off the socket, all in one call without the GIL. It stops
before any frame it does not expect, or a receive that has not begun within 20 ms, leaving the
rest to the Python engine: the frames are the same, so ranks on either path meet. A send the
socket takes only part of ends the run too, its rest queued first for the sender thread.

Frame header (little endian, 28 bytes): magic u32 | kind u16 | reserved u16 | check u32 |
tag u64 | nbytes u64, then ``nbytes`` of payload. DATA carries a message; ABORT carries an error
code (``ABORT_*``) in ``check`` and a UTF-8 reason of at most MAX_ABORT_REASON_BYTES; CLOSE says
the sender closed: the receiver stops sending on that socket (shutdown) so both ends see EOF.

Failures: a size or check-word mismatch fails that one receive (`CollectiveMismatchError`), after
draining the payload so the stream stays usable. CLOSE, EOF or a reset fail the pending and later
requests of that socket with `PeerFailureError`; messages that had fully arrived before stay
receivable. An ABORT (sent or received) and `close` fail everything on the pair at once; an
ABORT received aborts the whole context in turn (`pairs.PairTableContext._note_abort`).
"""

from ddlcore.transports.tcp.channel import Channel, TcpRequest
from ddlcore.transports.tcp.context import TcpContext, TcpTransport
from ddlcore.transports.tcp.pair import TcpPair
from ddlcore.transports.tcp.protocol import (
    _DATA,
    _HEADER,
    _MAGIC,
    _MAX_PENDING,
    _MAX_PENDING_PER_SOURCE,
    PROTOCOL_VERSION,
)

__all__ = [
    "Channel",
    "PROTOCOL_VERSION",
    "TcpContext",
    "TcpPair",
    "TcpRequest",
    "TcpTransport",
    "_DATA",
    "_HEADER",
    "_MAGIC",
    "_MAX_PENDING",
    "_MAX_PENDING_PER_SOURCE",
]
