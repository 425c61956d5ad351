"""A collective's small steps run natively over this rank's TCP sockets (`run_steps`, offered to
the engine as the context's ``run_steps``): lease the sockets the steps use, run the steps in
`_steps.run` with the GIL released, give the sockets back, and say from which step the Python engine
goes on. On a quiet socket a 4 KB exchange then costs two system calls and a reduction instead
of a request object, the matcher and a poll loop in Python per message.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
from ddlcore.transports.base import STEP_COLUMNS
from ddlcore.transports.tcp._steps import COLUMNS, OK, STALLED, run
from ddlcore.transports.tcp.protocol import _DATA, _HEADER, _MAGIC, _SPIN_S

if TYPE_CHECKING:
    from ddlcore.transports.tcp.channel import Channel
    from ddlcore.transports.tcp.context import TcpContext

# The layouts _steps reads and writes.
assert _HEADER.size == 28 and _HEADER.format == "<IHHIQQ"
assert COLUMNS == STEP_COLUMNS

# The largest message run natively: one frame that any socket's send buffer takes whole (Linux
# gives at least 16 KB, 2.5 MB by default on loopback), so a send never has to wait half-way.
MAX_STEP_BYTES = 1 << 16
# The most steps run natively (the small-message schedules have 2 log2(P) + a few).
MAX_STEPS = 64
# A receive that has not begun this long after its turn goes back to the Python engine, which
# waits out the call's deadline with the transport's failure handling; the sockets are leased
# only this long, so another thread's send waits at most this long behind a late peer.
_STOP_S = 0.02
_STOP_NS = int(_STOP_S * 1e9)
_SPIN_NS = int(_SPIN_S * 1e9)


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
) -> int:
    """`Context.run_steps` (the arguments are described there): the steps as far as they go
    natively; returns the index of the first step not done (0: none, the sockets were not free
    or the messages too large)."""
    nsteps = len(rows)
    if not nsteps or nsteps > MAX_STEPS or max_count * itemsize > MAX_STEP_BYTES:
        return 0
    fds = np.empty(nsteps, np.int32)
    wakes = np.empty(nsteps, np.int32)
    leased: dict[Channel, int] = {}
    try:
        used: dict[Channel, bool] = {}  # each socket the steps use: whether they read it
        channels = []
        for kind, peer, slot in rows[:, :3].tolist():
            ch = None
            if kind != 3:  # COPY: no socket
                ch = ctx.pair(peer)._channel_for(tag_base | slot)  # type: ignore[attr-defined]
                used[ch] = used.get(ch, False) or kind != 0
            channels.append(ch)
        for ch, reads in used.items():
            fd = ch.lease(reads)
            if fd < 0:
                return 0
            leased[ch] = fd
        for i, ch in enumerate(channels):
            fds[i], wakes[i] = (leased[ch], ch.wake_fd) if ch is not None else (-1, -1)
        status, step, err = run(
            rows,
            0,
            fds,
            wakes,
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
            _SPIN_NS,
            _STOP_NS,
            time.monotonic_ns() + int(timeout * 1e9),
        )
    finally:
        for ch in leased:
            ch.unlease()
    if status != OK:  # a frame broke half-way: this socket's stream is unusable
        ch = ctx.pair(int(rows[step, 1]))._channel_for(tag_base | int(rows[step, 2]))  # type: ignore[attr-defined]
        why: BaseException = (
            TimeoutError(f"no progress inside a message within {timeout:g} s")
            if status == STALLED
            else OSError(err, "EOF or error inside a message")
        )
        ch.broken(why, None)
    return step
