"""The TCP transport's wire protocol: the frame header and its kinds, the claim a connector
proves and the listener's answer (ACK), the timing constants, and `Frame`, an item of a
channel's send queue.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ddlcore.transports.tcp.channel import TcpRequest


PROTOCOL_VERSION = 3  # 2: the hello is a claim proven with the job's key; 3: auth's claims
_MAGIC = 0xDD1C7C90
_HEADER = struct.Struct("<IHHIQQ")
# The TCP fields of a connector's claim (``ddlcore.security.claims.Claim.extra``; the ranks, the
# world size, the job id and the address are the claim's own): version, nchannels, channel.
_CLAIM_EXTRA = struct.Struct("<HHH")
_ACK = struct.Struct("<IHHHH")  # magic, version, status, nchannels, 0
_DATA, _ABORT, _CLOSE = 1, 2, 3
_ACK_OK, _ACK_WRONG_PEER, _ACK_NCHANNELS, _ACK_DUPLICATE, _ACK_CLOSED = 0, 1, 2, 3, 4
# A connection that has not finished its handshake by then is dropped; a real one takes
# milliseconds (two round trips and four HMACs).
_HANDSHAKE_TIMEOUT_S = 10.0
# Pending handshakes at most, in all and from one source address. Fixed, not scaled with the
# job: each pending one holds a thread and an fd for up to _HANDSHAKE_TIMEOUT_S, so a stranger
# from one address (or from 127.0.0.x, many) must never get more than these. A real handshake
# takes milliseconds, and a real connector dropped at a cap retries (_RETRY_PAUSE_S), so a burst
# of many lower ranks connecting at once is slowed, never refused.
_MAX_PENDING = 128
_MAX_PENDING_PER_SOURCE = 32
_RETRY_PAUSE_S = (0.005, 0.1)  # a connector dropped by a busy listener retries: first, longest
_CLOSE_TIMEOUT_S = 2.0  # how long close() lets peers answer CLOSE before cutting sockets
_DRAIN_CHUNK = 1 << 20
# A waiting receive polls its socket this long before sleeping in poll(): a reply usually comes
# within microseconds, a sleep costs a wake-up of tens of µs on a VM (shm spins the same 50 µs).
_SPIN_S = 50e-6
# The receiver thread stays parked this long after the last waiter stopped reading, so back-to-back
# collectives never hand the socket back and forth; it bounds how late a message nobody waits for
# is read (it waits in the socket meanwhile).
_LINGER_S = 0.002
_MAX_POLL_MS = 2**31 - 1  # poll() takes a C int of milliseconds; longer waits loop
_CLOSE_FRAME = _HEADER.pack(_MAGIC, _CLOSE, 0, 0, 0, 0)
_NO_PAYLOAD = memoryview(b"")


class ProtocolError(Exception):
    """The peer sent something that is not a ddlcore tcp frame: the connection is dropped."""


@dataclass(slots=True)
class Frame:
    """An item of a channel's send queue: a frame's header, its payload (DATA), the request it
    completes (None for control frames), how many of its bytes are written already, and what
    owns the payload's memory where the view does not (held until the frame is written)."""

    header: bytes
    view: memoryview | None = None
    req: TcpRequest | None = None
    sent: int = 0
    keep: object = None


def shutdown_quietly(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
