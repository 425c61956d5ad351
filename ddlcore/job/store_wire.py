"""The rendezvous store's wire format and limits, shared by its server (``store_server``) and its
client (``store``).

A connection first runs the job-key handshake (``ddlcore.security.auth``), the client claiming the
store service and which rank of how many it is (``ddlcore.security.claims``); then requests and
replies alternate, one at a time. Fixed binary headers, raw bytes after them; nothing is pickled:

Request:  magic u16, op u8, flags u8 (0), key length u16, value length u32, arg i64, wait ms i64,
          then the key (UTF-8) and the value.
Reply:    magic u16, status u8, flags u8 (0), value length u32, arg i64, then the value.

``arg`` is: for SET the number of reads after which the value is freed (0: kept); for ADD the
amount; for WAIT_GE the target; for BARRIER ``size << 32 | rank``. A BARRIER that times out is
answered MISSING with a bitmap of the ranks that arrived (bit r of byte r // 8).
"""

from __future__ import annotations

import struct

MAX_KEY_BYTES = 1024
MAX_VALUE_BYTES = 64 << 20
# Longest wait a request may ask for (a week): past it, timeouts are clamped, never an error.
MAX_WAIT_S = 7 * 86400.0
# Largest barrier: its timeout answer carries a bitmap of size / 8 bytes.
MAX_BARRIER_SIZE = 1 << 24

MAGIC = 0xDD5C
REQUEST = struct.Struct("<HBBHIqq")
REPLY = struct.Struct("<HBBIq")

SET, GET, ADD, WAIT_GE, CHECK, DELETE, BARRIER = 1, 2, 3, 4, 5, 6, 7
OPS = frozenset((SET, GET, ADD, WAIT_GE, CHECK, DELETE, BARRIER))
OK, MISSING, ERROR, FAILED = 0, 1, 2, 3  # FAILED: the job failed at the store; the value says why


def wait_ms(wait_s: float) -> int:
    """A wait in whole milliseconds, clamped to [0, MAX_WAIT_S]."""
    return int(min(max(wait_s, 0.0), MAX_WAIT_S) * 1e3)


def barrier_arg(rank: int, size: int) -> int:
    return size << 32 | rank


def arrived_ranks(bitmap: bytes, size: int) -> list[int]:
    """The ranks marked in a barrier's timeout answer."""
    return [r for r in range(min(size, len(bitmap) * 8)) if bitmap[r >> 3] >> (r & 7) & 1]
