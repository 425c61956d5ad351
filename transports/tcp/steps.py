"""A collective's small steps run natively over this rank's TCP sockets (`run_steps`, offered to
the engine as the context's ``run_steps``): lease the sockets the steps use, run the steps in
`_steps.run` with the GIL released, give the sockets back, and say from which step the Python engine
goes on (and which send, if any, the channel's sender thread finishes). On a quiet socket a 4 KB exchange then costs two system calls and a reduction instead
of a request object, the matcher and a poll loop in Python per message.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from ddlcore.transports.base import STEP_COLUMNS, Request
from ddlcore.transports.tcp._steps import COLUMNS, OK, PARTIAL, STALLED, run
from ddlcore.transports.tcp.channel import Channel, TcpRequest
from ddlcore.transports.tcp.protocol import (
    _DATA,
    _HEADER,
    _MAGIC,
    Frame,
    shutdown_quietly,
)

if TYPE_CHECKING:
    from ddlcore.transports.tcp.context import TcpContext

# The layouts _steps reads and writes.
assert _HEADER.size == 28 and _HEADER.format == "<IHHIQQ"
assert COLUMNS == STEP_COLUMNS

# The largest message run natively. A send the socket takes only part of (a full send buffer)
# hands the rest to the channel's sender thread, so any size is safe; past this the engine's
# pipelining of a message's chunks is worth more than the system calls saved.
MAX_STEP_BYTES = 1 << 16
# The most steps run natively (the small-message schedules have 2 log2(P) + a few).
MAX_STEPS = 64
# A receive that has not begun this long after its turn goes back to the Python engine, which
# waits out the call's deadline with the transport's failure handling; the sockets are leased
# only this long, so another thread's send waits at most this long behind a late peer.
_STOP_S = 0.02
_STOP_NS = int(_STOP_S * 1e9)
# A receive's wait: it peeks at the socket, yielding the core between peeks, this long before it
# sleeps in poll() (the boards' DDL_A_YIELD_NS): a reply usually comes within microseconds,
# and a sleeping rank's wake-up costs tens on a VM.
_YIELD_NS = 100_000
_COPY, _SEND = 3, 0


def run_steps(
    ctx: TcpContext,
    rows: np.ndarray,
    max_count: int,
    tag_base: int,
    check: int,
    bufs: np.ndarray,
    staging: int,
    itemsize: int,
    dtype: int,
    op: int,
    divisor: int,
    timeout: float,
    keep: object = None,
) -> tuple[int, Request | None]:
    """`Context.run_steps` (the arguments are described there): the steps as far as they go
    natively (0: none, the sockets were not free or the messages too large)."""
    nsteps = len(rows)
    if not nsteps or nsteps > MAX_STEPS or max_count * itemsize > MAX_STEP_BYTES:
        return 0, None
    lanes = _lanes(ctx, rows, tag_base)
    if lanes is None:
        return 0, None
    channels = lanes.channels
    leased: list[Channel] = []
    try:
        for ch, reads in lanes.used:
            if ch.lease(reads) < 0:
                return 0, None
            leased.append(ch)
        status, step, err = run(
            rows,
            lanes.fds,
            lanes.wakes,
            bufs,
            staging,
            itemsize,
            _MAGIC,
            _DATA,
            tag_base,
            check,
            dtype,
            op,
            divisor,
            _YIELD_NS,
            _STOP_NS,
            time.monotonic_ns() + int(min(timeout, 1e8) * 1e9),  # no overflow for inf
        )
        pending = None
        if status == PARTIAL:
            pending = _send_the_rest(
                channels[step], rows[step], tag_base, check, bufs, itemsize, err, keep
            )
            step += 1
        elif status != OK:  # a frame broke half-way: this socket's stream is unusable
            _broken(channels[step], status, err, timeout)
    finally:
        for ch in leased:
            ch.unlease()
    return step, pending


@dataclass
class _Lanes:
    """The sockets a step table uses: each step's channel (None: a copy), each channel once
    with whether the steps read it, and each step's socket and eventfd for `_steps.run`."""

    rows: np.ndarray  # held, so that its id stays this table's while cached
    channels: list[Channel | None]
    used: list[tuple[Channel, bool]]
    fds: np.ndarray
    wakes: np.ndarray


def _lanes(ctx: TcpContext, rows: np.ndarray, tag_base: int) -> _Lanes | None:
    """``rows``' sockets (None: one is not connected yet). Kept per table where a step's
    channel does not depend on the call's tags (``tag % nchannels``: a power-of-two count)."""
    nch = ctx.nchannels
    cached = (nch & (nch - 1)) == 0
    cache = ctx.step_lanes
    lanes = cache.get(id(rows)) if cached else None
    if lanes is not None:
        return lanes
    channels: list[Channel | None] = []
    reads: dict[Channel, bool] = {}
    nsteps = len(rows)
    fds = np.full(nsteps, -1, np.int32)
    wakes = np.full(nsteps, -1, np.int32)
    for i, (kind, peer, slot) in enumerate(rows[:, :3].tolist()):
        ch = None
        if kind != _COPY:
            ch = ctx.pair(peer)._channel_for(tag_base | slot)  # type: ignore[attr-defined]
            if ch.sock is None or ch.wake_fd < 0:
                return None
            reads[ch] = reads.get(ch, False) or kind != _SEND
            fds[i], wakes[i] = ch.sock.fileno(), ch.wake_fd
        channels.append(ch)
    lanes = _Lanes(rows, channels, list(reads.items()), fds, wakes)
    if cached:
        if len(cache) >= 256:  # schedules come and go: keep the recent
            cache.clear()
        cache[id(rows)] = lanes
    return lanes


def _send_the_rest(
    ch: Channel | None,
    row: np.ndarray,
    tag_base: int,
    check: int,
    bufs: np.ndarray,
    itemsize: int,
    written: int,
    keep: object,
) -> Request:
    """The socket took ``written`` bytes of the frame of the send ``row``: the rest goes first
    when the channel's sender thread runs again, ``keep`` (the buffers' owners) held with it
    (the view is made from an address, and a failed call may return before it is written);
    returns the send's request."""
    assert ch is not None
    _, _, slot, count, src, src_off = row[:6].tolist()
    nbytes = count * itemsize
    data = (ctypes.c_char * nbytes).from_address(int(bufs[src]) + src_off * itemsize)
    view = memoryview(data).cast("B")
    tag = tag_base | slot
    req = TcpRequest(ch.pair, view, tag, check, True)
    ch.send_first(
        Frame(_HEADER.pack(_MAGIC, _DATA, 0, check, tag, nbytes), view, req, written, keep)
    )
    return req


def _broken(ch: Channel | None, status: int, err: int, timeout: float) -> None:
    """The frame being read broke half-way: fail the channel and shut its socket (the lease
    still held, so that no other reader takes the middle of a frame for a header)."""
    assert ch is not None
    why: BaseException = (
        TimeoutError(f"no progress inside a message within {timeout:g} s")
        if status == STALLED
        else OSError(err, "EOF or error inside a message")
    )
    ch.broken(why, None)
    if ch.sock is not None:
        shutdown_quietly(ch.sock)
