"""The UCX transport's wire protocol: control tags naming their source, the header of a control
message, payload tags keyed with the pair's token; and the records of work in flight
(`UcxRequest`, `Part`, `Control`, `Op`).
"""

from __future__ import annotations

import hashlib
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

from ddlcore.transports.base import MAX_ABORT_REASON_BYTES
from ddlcore.transports.common import Message, ThreadRequest

if TYPE_CHECKING:
    from ddlcore.transports.ucx.pair import UcxPair


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


class Part(NamedTuple):
    """A UCX send a request waits for, and the buffer it reads (kept alive until it is done)."""

    ucx: Any
    buf: Any


class Control(NamedTuple):
    """A control message UCX is receiving for a pair (handled in order once complete): the UCX
    request, its buffer, and the length the sender sent (the buffer may be cut at the cap)."""

    ucx: Any
    buf: bytearray
    length: int


class Op:
    """A UCX operation in flight, watched by the progress thread. The buffer UCX reads or writes
    is referenced here until UCX says it is finished with it."""

    __slots__ = ("ucx", "pair", "kind", "req", "msg", "buf")

    def __init__(
        self,
        ucx: Any,
        pair: UcxPair | None,
        kind: int,
        req: UcxRequest | None = None,
        msg: Message | None = None,
        buf: Any = None,
    ) -> None:
        self.ucx, self.pair, self.kind, self.req, self.msg, self.buf = (
            ucx,
            pair,
            kind,
            req,
            msg,
            buf,
        )
