"""The engine: executes one rank's `Schedule` over transports and kernels.

Execution is a single pass over the steps in program order, with receives posted ahead of time
(up to ``depth`` steps, each ``RECV_REDUCE`` taking one of ``depth`` staging slots). The
transports move bytes on their own threads, so while this thread reduces chunk k (a Cython
kernel that releases the GIL), chunk k+1 is being received and chunk k-1 sent.

Hazards are checked, not assumed: a receive is posted early only if no earlier, unprocessed step
touches its region and no send in flight reads it; a write (reduce, copy) waits for in-flight
sends of its region. Regions are compared by address, so in-place calls (input is output) are
safe.

A schedule with parts on several streams (`ddlcore.algorithms.schedule`: mdring pipelined
across the box's dimensions) runs each stream on a thread of its own, each with its staging
slots (`run_parts`, which the device engine shares); a part starts once the parts it comes
after have finished, sends included. The kernels and the transports' waits release the GIL, so
the streams' work overlaps.

Every wait has a deadline. A failure (timeout, lost peer, mismatch) is re-raised with the rank,
the collective, its sequence number and the step, after telling the peers (``links.abort``) so
that every rank fails fast instead of waiting out its own timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import ddlcore.kernels as kernels
from ddlcore.algorithms.schedule import Buf, Kind, Schedule
from ddlcore.errors import (
    CollectiveMismatchError,
    DDLError,
    DDLTimeoutError,
    abort_reason,
    rewrap,
    root_cause,
)
from ddlcore.ops import Op
from ddlcore.transports.common import abort_code

log = logging.getLogger("ddlcore")

_SEND, _RECV, _RECV_REDUCE, _COPY = Kind.SEND, Kind.RECV, Kind.RECV_REDUCE, Kind.COPY


@dataclass
class Region:
    """A host buffer the engine reads or writes: base address and a flat byte view."""

    ptr: int
    view: memoryview

    @classmethod
    def of(cls, array: np.ndarray) -> Region:
        flat = array.reshape(-1).view(np.uint8)
        return cls(kernels.array_address(flat) if flat.size else 0, memoryview(flat))  # type: ignore[arg-type]


class StagingPool:
    """Receive buffers for ``RECV_REDUCE`` steps, allocated once and reused by every collective;
    each further stream of a schedule with parts has a pool of its own (`for_stream`)."""

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self.regions: list[Region] = []
        self._streams: dict[int, StagingPool] = {}

    def for_stream(self, stream: int) -> StagingPool:
        pool = self._streams.get(stream)
        if pool is None:
            pool = self._streams[stream] = StagingPool()
        return pool

    def ensure(self, nslots: int, nbytes: int) -> list[Region]:
        if len(self._arrays) < nslots or (self._arrays and self._arrays[0].nbytes < nbytes):
            size = max(nbytes, self._arrays[0].nbytes if self._arrays else 0, 64)
            self._arrays = [np.empty(size, np.uint8) for _ in range(max(nslots, len(self._arrays)))]
            self.regions = [Region.of(a) for a in self._arrays]
        return self.regions


def failure_reason(exc: BaseException) -> str:
    """What a failure is called in an abort note: its message without our "rank R: " prefix,
    or its type where it has no message (KeyboardInterrupt)."""
    return abort_reason(exc, str(exc).split(": ", 1)[-1] or type(exc).__name__)


@dataclass
class Collective:
    """What the engine needs to know of the call, for tags, checks, reductions and messages."""

    seq: int
    check: int
    itemsize: int
    dtype_code: int
    op: Op | None
    # e.g. "allreduce #12 (1000 x float32, sum)"; or a function that makes it: messages are
    # rare, and formatting one costs a call ~10 us
    name: str | Callable[[], str]
    # Names another rank's call from the check word and length of its message, or None where
    # it cannot (`ddlcore.execution.check_words.describe_check`): for mismatch messages.
    peer_call: Callable[[int, int], str | None] | None = None

    @property
    def label(self) -> str:
        return self.name if isinstance(self.name, str) else self.name()


def pair_cache(links) -> Callable[[int], Any]:
    """``pair(peer)``: the link to ``peer``, looked up once per collective."""
    pairs: dict[int, Any] = {}

    def pair(peer: int) -> Any:
        p = pairs.get(peer)
        if p is None:
            p = pairs[peer] = links.pair(peer)
        return p

    return pair


def deadline_clock(timeout: float) -> Callable[[], float]:
    """``remaining()``: seconds left of ``timeout`` from now; raises `DDLTimeoutError` once
    none are."""
    monotonic = time.monotonic
    deadline = monotonic() + timeout

    def remaining() -> float:
        left = deadline - monotonic()
        if left <= 0:
            raise DDLTimeoutError(f"no progress within DDL_TIMEOUT={timeout:g} s")
        return left

    return remaining


def post_ahead(steps, i: int, nxt: int, depth: int, post_recv: Callable[[int, bool], bool]) -> int:
    """Post the receives of steps ``nxt`` .. ``i + depth - 1`` in order (``post_recv(j,
    early)``), stopping at the first that cannot be posted yet; returns the next step to try."""
    nsteps = len(steps)
    while nxt < nsteps and nxt - i < depth:
        kind = steps[nxt].kind
        if (kind == _RECV or kind == _RECV_REDUCE) and not post_recv(nxt, nxt > i):
            break
        nxt += 1
    return nxt


def run(
    schedule: Schedule,
    coll: Collective,
    buffers: dict[Buf, Region],
    links,
    staging: StagingPool,
    depth: int,
    timeout: float,
    start: int = 0,
    pending: Any = None,
    native: bool = True,
) -> None:
    """Execute ``schedule`` within ``timeout`` seconds; raise a `DDLError` with full context on
    failure (after aborting the links so the peers fail fast too). A schedule with parts runs
    each stream on a thread of its own (`run_parts`). ``start``: the steps before it are done
    (a schedule without parts; the links' native runner ran them), but for the send before it
    if ``pending`` (its request); ``native``: hand the steps to the links' runner first (False:
    it has had them)."""
    remaining = deadline_clock(timeout)
    if schedule.parts:

        def run_part(stream: int, p: int, links) -> None:
            index, steps = schedule.part_steps[p]
            if steps:
                pool = staging if stream == schedule.parts[0].stream else staging.for_stream(stream)
                _run_steps(schedule, steps, index, coll, buffers, links, pool, depth, remaining)

        run_parts(schedule, coll, links, remaining, run_part)
    elif schedule.steps:
        _run_steps(
            schedule,
            schedule.steps,
            None,
            coll,
            buffers,
            links,
            staging,
            depth,
            remaining,
            getattr(links, "run_steps", None) if native and not start else None,
            start,
            pending,
        )


def _run_steps(
    schedule: Schedule,
    steps,
    index,
    coll: Collective,
    buffers: dict[Buf, Region],
    links,
    staging: StagingPool,
    depth: int,
    remaining: Callable[[], float],
    native: Callable[..., tuple[int, Any]] | None = None,
    start: int = 0,
    pending: Any = None,
) -> None:
    """Run ``steps`` (all of ``schedule``'s, or one part's, ``index`` then giving each one's
    place in the schedule for messages) in program order from ``start`` (``pending``: the
    request of the send before it, still going out); ``native``: the links' runner of whole
    schedules (`Context.run_steps`), which goes first, as far as it goes."""
    nsteps = len(steps)
    isz = coll.itemsize
    tag_base = (coll.seq & 0xFFFFFFFF) << 32
    check = coll.check
    kop = int(Op.SUM if coll.op in (None, Op.AVG) else coll.op)
    code = int(coll.dtype_code)
    divide = coll.op == Op.AVG and schedule.size > 1
    max_bytes = max((s.count for s in steps if s.kind == _RECV_REDUCE), default=0) * isz
    slots = staging.ensure(depth, max_bytes) if max_bytes else []
    free = list(range(len(slots)))
    posted: list = [None] * nsteps
    staged: list[int] = [-1] * nsteps
    sends: deque = deque()  # (lo, hi, request) of sends in flight, oldest first
    pair = pair_cache(links)
    i = 0

    def span(buf: Buf, off: int, count: int) -> tuple[int, int]:
        lo = buffers[buf].ptr + off * isz
        return lo, lo + count * isz

    def wait_sends_over(lo: int, hi: int) -> None:
        for slo, shi, req in sends:
            if slo < hi and lo < shi:
                req.wait(remaining())

    def touches(j: int, lo: int, hi: int) -> bool:
        s = steps[j]
        if s.kind != _RECV and s.count:
            a, b = span(s.src, s.src_off, s.count)
            if a < hi and lo < b:
                return True
        if s.kind != _SEND and s.count:
            a, b = span(s.dst, s.dst_off, s.count)
            if a < hi and lo < b:
                return True
        return False

    def post_recv(j: int, early: bool) -> bool:
        s = steps[j]
        nbytes = s.count * isz
        if s.kind == _RECV_REDUCE:
            if not free:
                return False
            slot = free.pop()
            view = slots[slot].view[:nbytes]
            staged[j] = slot
        else:
            lo, hi = span(s.dst, s.dst_off, s.count)
            if early:
                if any(touches(k, lo, hi) for k in range(i, j)):
                    return False
                if any(slo < hi and lo < shi for slo, shi, _ in sends):
                    return False
            else:
                wait_sends_over(lo, hi)
            base = buffers[s.dst]
            view = base.view[lo - base.ptr : hi - base.ptr]
        posted[j] = pair(s.peer).irecv(view, tag_base | s.slot, check)
        return True

    i = start
    try:
        if native is not None:
            table = schedule.table
            start, pending = native(
                table.rows,
                table.max_count,
                tag_base,
                check,
                _addresses(buffers),
                slots[0].ptr if slots else 0,
                isz,
                code,
                kop,
                schedule.size if divide else 0,
                remaining(),
                buffers,  # their Regions' views hold the arrays
            )
        if pending is not None:  # the runner's last send: a region not to write yet
            s = steps[start - 1]
            sends.append((*span(s.src, s.src_off, s.count), pending))
            i = start - 1  # a failure while it goes out is that step's
        nxt = start  # next step to consider for early posting
        for i in range(start, nsteps):
            nxt = post_ahead(steps, i, max(nxt, i), depth, post_recv)
            while sends and sends[0][2].test():
                sends.popleft()

            s = steps[i]
            kind = s.kind
            if kind == _SEND:
                lo, hi = span(s.src, s.src_off, s.count)
                base = buffers[s.src]
                req = pair(s.peer).isend(
                    base.view[lo - base.ptr : hi - base.ptr], tag_base | s.slot, check
                )
                sends.append((lo, hi, req))
                continue
            if kind == _COPY:
                lo, hi = span(s.dst, s.dst_off, s.count)
                src_lo = buffers[s.src].ptr + s.src_off * isz
                if src_lo != lo:
                    wait_sends_over(lo, hi)
                    kernels.copy_bytes(lo, src_lo, hi - lo)
                continue
            if posted[i] is None:
                post_recv(i, False)
                if nxt == i:
                    nxt = i + 1
            posted[i].wait(remaining())
            posted[i] = None
            if kind == _RECV_REDUCE:
                lo, hi = span(s.dst, s.dst_off, s.count)
                wait_sends_over(lo, hi)
                slot = staged[i]
                own, staged_ptr = buffers[s.src].ptr + s.src_off * isz, slots[slot].ptr
                if s.staged_first:
                    own, staged_ptr = staged_ptr, own
                kernels.reduce_copy(lo, own, staged_ptr, s.count, code, kop)
                if divide and s.finalize:
                    kernels.avg_finalize(lo, s.count, code, schedule.size)
                free.append(slot)
        while sends:
            _, _, req = sends.popleft()
            req.wait(remaining())
    except DDLError as exc:
        raise failure(schedule, coll, i if index is None else index[i], exc, links) from None


def _addresses(buffers: dict[Buf, Region]) -> np.ndarray:
    """The buffers' addresses by `Buf` number (0: none), for a native runner."""
    return np.array([buffers[b].ptr if b in buffers else 0 for b in Buf], np.uint64)


def run_parts(
    schedule: Schedule,
    coll: Collective,
    links,
    remaining: Callable[[], float],
    run_part: Callable[[int, int, Any], None],
    thread_context: Callable[[], Any] = contextlib.nullcontext,
) -> None:
    """Run each stream of ``schedule`` (a schedule with parts) on a thread (the first on this
    one, the others inside ``thread_context()``): ``run_part(stream, part, links)`` for each of
    the stream's parts in order, a part once the parts it comes after have finished. The first
    failure aborts the links (so the other streams' waits end at once), the other threads are
    joined, and it is raised here."""
    parts, groups = schedule.parts, schedule.part_steps
    done = [False] * len(parts)
    failed: list[BaseException] = []
    cond = threading.Condition()
    links = _FirstAbort(links)  # the stream that fails first is the one to report

    def wait_for(p: int) -> bool:
        """Wait until the parts ``p`` comes after have finished; False if a stream failed."""
        after = parts[p].after
        with cond:
            while not failed and not all(done[q] for q in after):
                try:
                    cond.wait(min(remaining(), 1.0))
                except DDLError as exc:  # our deadline: fail where this stream stands
                    first = groups[p][0][0] if groups[p][0] else 0
                    raise failure(schedule, coll, first, exc, links) from None
            return not failed

    def run_stream(stream: int, mine: list[int]) -> None:
        try:
            for p in mine:
                if not wait_for(p):
                    return
                run_part(stream, p, links)
                with cond:
                    done[p] = True
                    cond.notify_all()
        except BaseException as exc:
            if not isinstance(exc, DDLError):  # e.g. Ctrl-C: tell the peers (DDLErrors did)
                links.abort(abort_code(exc), failure_reason(exc))
            with cond:
                # The streams the abort woke fail too: the cause goes first.
                failed.insert(0 if links.first == threading.get_ident() else len(failed), exc)
                cond.notify_all()

    def run_thread(stream: int, mine: list[int]) -> None:
        with thread_context():
            run_stream(stream, mine)

    streams = schedule.streams()
    first = parts[0].stream
    threads = [
        threading.Thread(target=run_thread, args=(k, mine), daemon=True, name=f"ddlcore-stream-{k}")
        for k, mine in streams.items()
        if k != first
    ]
    for t in threads:
        t.start()
    try:
        run_stream(first, streams[first])
        for t in threads:
            t.join()  # their waits end by the deadline, or at once once the links are aborted
    except BaseException as exc:  # Ctrl-C while joining: stop the other streams first
        links.abort(abort_code(exc), failure_reason(exc))
        for t in threads:
            t.join(_JOIN_AFTER_ABORT_S)
        raise
    if failed:
        raise failed[0]


class _FirstAbort:
    """A communicator's links that remember which thread aborted them first."""

    def __init__(self, links) -> None:
        self._links = links
        self.pair = links.pair
        self.explain = getattr(links, "explain", None)  # see `explained`
        self.first: int | None = None
        self._lock = threading.Lock()

    def abort(self, code: int, reason: str) -> None:
        with self._lock:
            if self.first is None:
                self.first = threading.get_ident()
        self._links.abort(code, reason)


def explained(exc: DDLError, links) -> DDLError:
    """``exc``, or the abort a peer it blames left a note of (`Links.explain`; the stand-in
    links of unit tests have none)."""
    explain = getattr(links, "explain", None)
    return exc if explain is None else explain(exc)


# How long an interrupted call waits for its other streams once the links are aborted (their
# waits end at once then; a stream inside a kernel call finishes it first).
_JOIN_AFTER_ABORT_S = 5.0

_PINNED: list = []  # buffers of failed agreement checks (see `agree`)


def agree(
    rank: int,
    size: int,
    seq: int,
    check: int,
    mine: bytes,
    links,
    timeout: float,
    label: str,
    describe: Callable[[bytes], str],
) -> None:
    """Compare this rank's description of the call (``mine``, the same length on every rank)
    with every other rank's, by dissemination: in round k, send the description to rank +
    2^k and compare the one from rank - 2^k before going on, so a rank that finishes has
    (through the others' comparisons) matched every rank. For transports without check words
    on the wire (MPI), where the schedules' own messages cannot judge agreement (`agreement`).
    Raises `CollectiveMismatchError` naming both calls, after aborting the links."""
    remaining = deadline_clock(timeout)
    tag = (seq & 0xFFFFFFFF) << 32  # slot 0 of the collective's own tags
    out, theirs = bytearray(mine), bytearray(len(mine))
    pair = pair_cache(links)
    dist = 1
    try:
        while dist < size:
            to, frm = (rank + dist) % size, (rank - dist) % size
            sent = pair(to).isend(memoryview(out), tag, check)
            pair(frm).irecv(memoryview(theirs), tag, check).wait(remaining())
            # Finished before we may raise: MPI must not be left a send from freed memory.
            sent.wait(remaining())
            if theirs != out:
                raise CollectiveMismatchError(
                    f"rank {frm} called {describe(bytes(theirs))}, rank {rank} called "
                    f"{describe(bytes(out))}: every rank must call the same collectives in "
                    "the same order, with the same count, dtype, op and root"
                )
            dist *= 2
    except DDLError as exc:
        # A receive or send may still be posted (an abort ended the wait): MPI may write
        # into these later, so they are never freed (once per failed communicator).
        _PINNED.append((out, theirs))
        exc = explained(exc, links)
        message = f"rank {rank}: {label}: agreement check failed: {exc}"
        err = rewrap(exc, message)  # keeps whom it blames, and a told failure's origin
        links.abort(abort_code(exc), abort_reason(err, message.split(": ", 1)[1]))
        raise err from None


def failure(schedule: Schedule, coll: Collective, i: int, exc: DDLError, links) -> DDLError:
    """The error to raise for ``exc`` at step ``i``: the same class, with the rank, the
    collective, its sequence number and the step in the message. Tells the peers first
    (``links.abort``) so that every rank fails fast instead of waiting out its own timeout."""
    exc = explained(exc, links)  # a peer that left before we reached it: why it did
    steps = schedule.steps
    step = steps[min(i, len(steps) - 1)].describe()
    message = (
        f"rank {schedule.rank}: {coll.label} via {schedule.algorithm} failed at step "
        f"{i + 1} of {len(steps)} [{step}]: {exc}"
    )
    if isinstance(exc, DDLTimeoutError):
        message += (
            ". A peer may have died, be stuck, or be calling a different collective; "
            "raise DDL_TIMEOUT if the job is just slow"
        )
    named = _peer_call(coll, exc, schedule.rank)
    message += named
    # peers hear the cause (``exc``, and whom it names), not our step
    err = rewrap(exc, message, root_cause(exc) + named if named else None)
    # Peers prefix the reason with "rank R aborted:", so send it without our own prefix.
    links.abort(abort_code(exc), abort_reason(err, message.split(": ", 1)[1]))
    return err


def _peer_call(coll: Collective, exc: DDLError, rank: int) -> str:
    """For a message that did not match its receive (a transport's `mismatch_error`), what
    the sender called and what this ``rank`` did, by name (peers told of the failure read
    both); "" for other failures."""
    sent = getattr(exc, "sent", None)
    if sent is None or coll.peer_call is None:
        return ""
    peer, nbytes, check = sent
    theirs = coll.peer_call(check, nbytes)
    if theirs is not None:
        return f"; rank {peer} called {theirs} where rank {rank} called {coll.label}"
    posted, isz = getattr(exc, "posted", None), coll.itemsize
    held = (
        f" (its message held {nbytes // isz} elements where rank {rank} expected {posted // isz})"
        if posted not in (None, nbytes) and isz and not nbytes % isz and not posted % isz
        else ""
    )
    return (
        f"; rank {peer} called what rank {rank} cannot name from its check word{held}, where "
        f"rank {rank} called {coll.label}: a collective of a count further from this one's, or "
        "on device buffers where this rank has host buffers"
    )
