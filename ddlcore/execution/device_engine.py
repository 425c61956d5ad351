"""The engine for device (CUDA) buffers: the same `Schedule` the host engine runs, with every
chunk pipelined over three CUDA streams.

Data moves through pinned host slots (the transports send and receive host memory); the GPU
work for each step is queued on a stream and ordered by events, never by synchronising the
device::

    SEND         d2h:      [wait last write of the span] device span -> pinned send slot
                 host:     isend the slot once the copy's event has fired
    RECV_REDUCE  host:     irecv into a pinned receive slot (posted up to `depth` steps ahead)
                 h2d:      pinned slot -> device slot
                 compute:  [wait h2d] dst = src OP device slot  (+ avg's division when final)
    RECV         compute:  pinned slot -> device span
    COPY         compute:  device span -> device span

    time ->   chunk k:   net ===== h2d == reduce == d2h == net =====
              chunk k+1:           net ===== h2d == reduce == d2h == net =====

While chunk k+1 is on the wire, chunk k is uploaded, reduced and downloaded, and the transports'
threads move chunk k-1's bytes. All writes to the caller's buffers happen on ``compute`` in
program order; ``d2h`` reads a span only after the event of the last write to it, and a write
waits for the downloads still reading its span (regions are compared by address, so in-place
calls are safe). The host thread never blocks on the network while a download it has queued
is unsent, so no rank can wait for a message that sits in its own queue.

Direct device transfers: when the pair to a step's peer takes device memory (UCX with CUDA,
CUDA-aware MPI; ``Pair.device_memory``), that step skips the pinned slots::

    SEND         host:     isend the device span itself once its last write's event has fired
                           (later writes to the span wait, on the host, for the send to finish)
    RECV_REDUCE  host:     irecv straight into a device slot; compute reduces from it
    RECV         host:     irecv into a device slot; compute copies it into the span

A schedule with parts on several streams (mdring pipelined across dimensions) runs as on the
host engine (`ddlcore.execution.engine.run_parts`): each schedule stream on a host thread of its own with
its own three CUDA streams and slots (`DeviceSlots.for_stream`), so one segment's phase on one
link overlaps the next segment's phase on another. A part's streams wait (on the GPU) for the
end event of each part it comes after; its host thread first waits for the end of the previous
part on its own stream, whose slots it reuses. Where the device runs work at once and its kernels
share module state (Numba's simulator: ``DeviceOps.concurrent`` false), the parts run in program
order, a valid serial order of them.

What touches CUDA is behind `DeviceOps` (`ddlcore.device.NumbaStreams` in production, Numba's
simulator in CI); the tests also drive the engine with ops that run queued work in random valid
orders, which is how the ordering above is checked without a GPU.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ddlcore.algorithms.schedule import Buf, Kind, Schedule
from ddlcore.device_ops import DeviceRegion, DeviceSlots
from ddlcore.errors import DDLError
from ddlcore.execution.engine import (
    Collective,
    deadline_clock,
    failure,
    pair_cache,
    post_ahead,
    run_parts,
)
from ddlcore.kernels.dtypes import DType
from ddlcore.ops import Op

_SEND, _RECV, _RECV_REDUCE, _COPY = Kind.SEND, Kind.RECV, Kind.RECV_REDUCE, Kind.COPY
_PRUNE_AT = 32  # ordering records kept before finished ones are dropped (keeps overlap scans short)
# The chunk of a device schedule where DDL_CHUNK_BYTES is unset. Every chunk costs a few Numba
# launches and event waits (~0.6 ms of host work on an H100 host); 2 ranks on one H100 over shm,
# 256 MiB allreduce busbw: 1 MiB 0.9-1.2 GB/s, 2 MiB 2.4, 4 MiB 4.1, 8 and 16 MiB 2.5 (BENCHMARKS).
CHUNK_BYTES = 4 << 20


def run(
    schedule: Schedule,
    coll: Collective,
    buffers: dict[Buf, DeviceRegion],
    links,
    slots: DeviceSlots,
    depth: int,
    timeout: float,
    ready: Any = None,
) -> None:
    """Execute ``schedule`` on device buffers within ``timeout`` seconds.

    ``ready`` is an event recorded on the caller's stream (None: the legacy default stream):
    every stream, and every direct send, waits for it, so work the caller queued before the
    collective is seen. Returns when the result is in the output buffer (the streams have been
    synchronised). Failures raise as in `ddlcore.execution.engine.run`, after aborting the links."""
    if not schedule.steps:
        return
    remaining = deadline_clock(timeout)
    first = [] if ready is None else [ready]
    streams = schedule.streams()

    def run_steps(steps, index, links, own: DeviceSlots, waits: list, finish: bool) -> Any:
        return _run_steps(
            schedule, steps, index, coll, buffers, links, own, depth, timeout, remaining,
            waits, finish,
        )  # fmt: skip

    if len(streams) < 2 or not slots.ops.concurrent:
        run_steps(schedule.steps, None, links, slots, first, True)
        return
    parts = schedule.parts
    ends: list[Any] = [None] * len(parts)  # each part's end event on its compute stream
    last_on: dict[int, Any] = {}  # each stream's last finished part's end event

    def run_part(stream: int, p: int, links) -> None:
        index, steps = schedule.part_steps[p]
        own = slots if stream == parts[0].stream else slots.for_stream(stream)
        before = last_on.get(stream)
        if before is not None:  # its slots are ours again once its device work is done
            try:
                own.ops.sync(before, remaining())
            except DDLError as exc:  # the peers must hear of it too
                raise failure(schedule, coll, index[0] if index else 0, exc, links) from None
        waits = [ends[q] for q in parts[p].after] + ([before] if before is not None else first)
        last = p == streams[stream][-1]
        ends[p] = last_on[stream] = run_steps(steps, index, links, own, waits, last)

    run_parts(schedule, coll, links, remaining, run_part, slots.ops.bound)


def _run_steps(
    schedule: Schedule,
    steps,
    index,
    coll: Collective,
    buffers: dict[Buf, DeviceRegion],
    links,
    slots: DeviceSlots,
    depth: int,
    timeout: float,
    remaining,
    waits: list,
    finish: bool,
) -> Any:
    """Run ``steps`` (all of ``schedule``'s, or one part's, ``index`` then giving each one's
    place in the schedule for messages) in program order, after the events ``waits``; returns
    the event that ends their device work (waited for first when ``finish``)."""
    nsteps = len(steps)
    ops = slots.ops
    compute, d2h, h2d = ops.compute, ops.d2h, ops.h2d
    isz = coll.itemsize
    tag_base = (coll.seq & 0xFFFFFFFF) << 32
    check = coll.check
    kop = Op.SUM if coll.op in (None, Op.AVG) else coll.op
    code = DType(coll.dtype_code)
    divide = coll.op == Op.AVG and schedule.size > 1
    max_bytes = max((s.count for s in steps if s.kind != _COPY), default=0) * isz
    nslots = max(2, depth)
    slots.ensure(nslots, max_bytes)
    free_send = list(range(len(slots.send)))
    free_recv = list(range(nslots))
    busy_recv: deque = deque()  # (slot, event after which its pinned and device slots are free)
    writes: list = []  # (lo, hi, event) of compute-stream writes to the buffers
    reads: list = []  # (lo, hi, event) of downloads reading the buffers
    queued: deque = deque()  # (event, slot, peer, tag, payload, lo, hi): sends not yet posted
    inflight: deque = deque()  # (slot, request) of sends from pinned slots on the wire
    direct_sends: list = []  # (lo, hi, request) of sends reading the buffers themselves
    direct: dict[int, bool] = {}  # peer -> its pair takes device memory
    posted: list = [None] * nsteps
    recv_slot = [-1] * nsteps
    pair = pair_cache(links)
    ready: Any = None  # fires after ``waits``: set first thing below
    i = 0

    def is_direct(peer: int) -> bool:
        found = direct.get(peer)
        if found is None:
            found = direct[peer] = bool(getattr(pair(peer), "device_memory", False))
        return found

    def span(buf: Buf, off: int, count: int) -> tuple[int, int]:
        lo = buffers[buf].ptr + off * isz
        return lo, lo + count * isz

    def prune(records: list) -> list:
        return [r for r in records if not ops.done(r[2])] if len(records) > _PRUNE_AT else records

    def after_reads(stream, lo: int, hi: int) -> None:
        """Make ``stream`` wait for the downloads still reading [lo, hi)."""
        for rlo, rhi, ev in reads:
            if rlo < hi and lo < rhi:
                ops.wait(stream, ev)

    def last_write(lo: int, hi: int) -> Any:
        """The event after which [lo, hi) holds its latest value (compute is in order: the last
        overlapping write's event covers the earlier ones; none: the caller's ``ready``)."""
        for wlo, whi, ev in reversed(writes):
            if wlo < hi and lo < whi:
                return ev
        return ready

    def after_last_write(stream, lo: int, hi: int) -> None:
        ev = last_write(lo, hi)
        if ev is not ready:  # every stream waited for ready already
            ops.wait(stream, ev)

    def send_queued(block: bool) -> None:
        """isend the queued sends whose data is ready (all of them when ``block``)."""
        while queued and (block or ops.done(queued[0][0])):
            ev, slot, peer, tag, payload, lo, hi = queued.popleft()
            ops.sync(ev, remaining())
            req = pair(peer).isend(payload, tag, check)
            if slot < 0:  # kept apart: a slow one must not hold back freeing pinned slots
                direct_sends.append((lo, hi, req))
            else:
                inflight.append((slot, req))

    def after_direct_sends(lo: int, hi: int) -> None:
        """Before a write to [lo, hi): wait (on the host) for direct sends still reading it."""
        nonlocal direct_sends
        if any(slot < 0 and qlo < hi and lo < qhi for _, slot, _, _, _, qlo, qhi in queued):
            send_queued(True)
        for slo, shi, req in direct_sends:
            if slo < hi and lo < shi:
                wait_request(req)
        if len(direct_sends) > _PRUNE_AT:
            direct_sends = [d for d in direct_sends if not d[2].test()]

    def before_write(lo: int, hi: int) -> None:
        after_reads(compute, lo, hi)
        if direct_sends or queued:
            after_direct_sends(lo, hi)

    def wait_request(req) -> None:
        """Wait for a network request; first send everything queued, so that no peer waits
        for a message that only our own queue holds."""
        if queued and not req.test():
            send_queued(True)
        req.wait(remaining())

    def retire_sends() -> None:
        """Free the pinned slots of the sends that have finished, oldest first."""
        while inflight and inflight[0][1].test():
            free_send.append(inflight.popleft()[0])

    def send_slot() -> int:
        # Never wait for a send here: over MPI (or shm's single-copy path) a large send ends
        # only when the peer posts the receive, which it may do only after OUR receives (rhd
        # sends a whole half before receiving). Like the host engine, which sends from the
        # caller's buffer, keep every send in flight: take another slot instead.
        retire_sends()
        return free_send.pop() if free_send else slots.another_send_slot()

    def recv_slot_for(early: bool) -> int:
        while busy_recv and ops.done(busy_recv[0][1]):
            free_recv.append(busy_recv.popleft()[0])
        if not free_recv:
            if early or not busy_recv:
                return -1
            slot, ev = busy_recv.popleft()
            ops.sync(ev, remaining())
            free_recv.append(slot)
        return free_recv.pop()

    def post_recv(j: int, early: bool) -> bool:
        s = steps[j]
        if not s.count:  # an agreement message (`agreement`): its check word is all it says
            posted[j] = pair(s.peer).irecv(memoryview(bytearray(0)), tag_base | s.slot, check)
            return True
        slot = recv_slot_for(early)
        if slot < 0:
            return False
        recv_slot[j] = slot
        nbytes = s.count * isz
        view: Any
        if is_direct(s.peer):  # straight into the device slot (free: its last use has ended)
            view = ops.view(slots.staged[slot], 0, nbytes)
        else:
            view = memoryview(slots.recv[slot])[:nbytes]  # type: ignore[arg-type]
        posted[j] = pair(s.peer).irecv(view, tag_base | s.slot, check)
        return True

    def wrote(lo: int, hi: int, slot: int = -1) -> None:
        nonlocal writes, reads
        ev = ops.record(compute)
        writes = prune(writes)
        reads = prune(reads)
        writes.append((lo, hi, ev))
        if slot >= 0:
            busy_recv.append((slot, ev))

    nxt = 0  # next step to consider for early posting
    try:
        # With no events to wait for, the caller's work is on the legacy default stream: our
        # streams are blocking, so their copies wait for it implicitly, but a direct
        # transport's reads do not. An event on ``compute`` fires after it and after ``waits``
        # (and is what a direct send of input waits for).
        for ev in waits:
            ops.wait(compute, ev)
        ready = ops.record(compute)
        ops.wait(d2h, ready)
        ops.wait(h2d, ready)
        for i in range(nsteps):
            nxt = post_ahead(steps, i, max(nxt, i), depth, post_recv)
            send_queued(False)
            retire_sends()

            s = steps[i]
            kind = s.kind
            if kind == _SEND:
                lo, hi = span(s.src, s.src_off, s.count)
                base = buffers[s.src]
                tag = tag_base | s.slot
                if not s.count:  # an agreement message: no device work behind it
                    direct_sends.append((lo, lo, pair(s.peer).isend(memoryview(b""), tag, check)))
                    continue
                if is_direct(s.peer):
                    queued.append(
                        (
                            last_write(lo, hi),
                            -1,
                            s.peer,
                            tag,
                            ops.view(base, lo - base.ptr, hi - lo),
                            lo,
                            hi,
                        )
                    )
                    continue
                slot = send_slot()
                after_last_write(d2h, lo, hi)
                ops.download(base, lo - base.ptr, slots.send[slot][: hi - lo], d2h)
                ev = ops.record(d2h)
                reads.append((lo, hi, ev))
                payload = memoryview(slots.send[slot])[: hi - lo]  # type: ignore[arg-type]
                queued.append((ev, slot, s.peer, tag, payload, lo, hi))
                continue
            if kind == _COPY:
                lo, hi = span(s.dst, s.dst_off, s.count)
                src_lo = buffers[s.src].ptr + s.src_off * isz
                if src_lo != lo:
                    before_write(lo, hi)
                    dst, src = buffers[s.dst], buffers[s.src]
                    ops.copy(dst, lo - dst.ptr, src, src_lo - src.ptr, hi - lo, compute)
                    wrote(lo, hi)
                continue
            if posted[i] is None:
                post_recv(i, False)
                if nxt == i:
                    nxt = i + 1
            wait_request(posted[i])
            posted[i] = None
            if not s.count:
                continue
            slot = recv_slot[i]
            lo, hi = span(s.dst, s.dst_off, s.count)
            dst = buffers[s.dst]
            staged = slots.staged[slot]
            on_device = is_direct(s.peer)
            if kind == _RECV:
                before_write(lo, hi)
                if on_device:
                    ops.copy(dst, lo - dst.ptr, staged, 0, hi - lo, compute)
                else:
                    ops.upload(slots.recv[slot][: hi - lo], dst, lo - dst.ptr, compute)
                wrote(lo, hi, slot)
                continue
            if not on_device:
                ops.upload(slots.recv[slot][: hi - lo], staged, 0, h2d)
                ops.wait(compute, ops.record(h2d))
            before_write(lo, hi)
            src = buffers[s.src]
            own, own_off, other, other_off = src, s.src_off * isz, staged, 0
            if s.staged_first:
                own, own_off, other, other_off = staged, 0, src, s.src_off * isz
            ops.reduce(
                dst, lo - dst.ptr, own, own_off, other, other_off, s.count, code, kop, compute
            )
            if divide and s.finalize:
                ops.scale(dst, lo - dst.ptr, s.count, code, schedule.size, compute)
            wrote(lo, hi, slot)
        send_queued(True)
        while inflight:
            inflight.popleft()[1].wait(remaining())
        for _, _, req in direct_sends:
            req.wait(remaining())
        end = ops.record(compute)
        if finish:
            ops.sync(end, remaining())
        return end
    except BaseException as exc:
        if not isinstance(exc, DDLError):  # a CUDA error, say: the peers must hear of it too
            if not isinstance(exc, Exception):
                raise
            exc = DDLError(f"{type(exc).__name__}: {exc}")
        err = failure(schedule, coll, i if index is None else index[i], exc, links)
        # Let queued device work finish before the slots it uses can be reused or freed (the
        # communicator is broken from now on); best effort, the error above is what counts.
        for stream in (compute, d2h, h2d):
            try:
                ops.sync(ops.record(stream), max(1.0, min(timeout, 10.0)))
            except Exception:
                break
        raise err from None
