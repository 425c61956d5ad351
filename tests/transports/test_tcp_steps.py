"""The tcp transport's native steps (``transports/tcp/_steps.pyx``, ``steps.run_steps``): a
collective's small messages sent and received straight over the leased sockets, with the
Python engine's frames. It must stop cleanly before any step it cannot do at once (another
frame first, a check word or size that differs, nothing yet, the eventfd), leaving that frame
to the Python path; and over real ranks give the Python path's bits, alone or mixed with it."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from tests.collectives import matrix
from tests.harness import count_python_calls, patch, run_ranks

TCP = {"DDL_TRANSPORT": "tcp"}
HEADER = struct.Struct("<IHHIQQ")
SEND, RECV, RECV_REDUCE, COPY = 0, 1, 2, 3
CHECK = 0x1235
TAG_BASE = 7 << 32


def _native():
    from ddlcore.transports.tcp import _steps
    from ddlcore.transports.tcp.protocol import _DATA, _MAGIC

    return _steps, _MAGIC, _DATA


def _run(
    rows, fd, bufs, staging, itemsize=4, dtype=2, op=0, divisor=0, stop_s=1.0, timeout=5.0, wake=-1
):
    _steps, magic, data = _native()
    rows = np.array(rows, np.int64).reshape(-1, 9)
    n = len(rows)
    return _steps.run(
        rows,
        np.full(n, fd, np.int32),
        np.full(n, wake, np.int32),
        np.array(bufs, np.uint64),
        staging,
        itemsize,
        magic,
        data,
        TAG_BASE,
        CHECK,
        dtype,
        op,
        divisor,
        0,
        int(stop_s * 1e9),
        time.monotonic_ns() + int(timeout * 1e9),
    )


def _frame(tag_slot=0, nbytes=0, check=CHECK, kind=None):
    _steps, magic, data = _native()
    return HEADER.pack(magic, data if kind is None else kind, 0, check, TAG_BASE | tag_slot, nbytes)


# (The integer avg is exact in Python, int_avg: never a divisor here.)
@pytest.mark.parametrize(
    "dtype,op",
    [
        (d, op)
        for d in (np.float32, np.float64, np.int32, np.float16)
        for op in ("sum", "max", "avg")
        if not (op == "avg" and d is np.int32)
    ],
)
@pytest.mark.parametrize("count", [1, 7, 1031])
def test_an_exchange_reduces_in_one_order_on_both_ends(dtype, op, count):
    from ddlcore.kernels.dtypes import dtype_code

    a, b = socket.socketpair()
    xs = [matrix.random_input(dtype, count, r, count, op) for r in range(2)]
    outs = [np.empty_like(x) for x in xs]
    stages = [np.empty_like(x) for x in xs]
    results = [None, None]
    code, kop = dtype_code(np.dtype(dtype)), {"sum": 0, "avg": 0, "max": 3}[op]

    def side(r, sock):
        # Rank 1 reduces (staged = rank 0's) first, as the schedules order it.
        rows = [
            (SEND, 1 - r, 0, count, 0, 0, 1, 0, 0),
            (RECV_REDUCE, 1 - r, 0, count, 0, 0, 1, 0, 1 | (2 if r else 0)),
        ]
        results[r] = _run(
            rows,
            sock.fileno(),
            [xs[r].ctypes.data, outs[r].ctypes.data, 0],
            stages[r].ctypes.data,
            xs[r].itemsize,
            code,
            kop,
            2 if op == "avg" else 0,
        )

    threads = [threading.Thread(target=side, args=(r, s)) for r, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [(0, 2, 0), (0, 2, 0)]
    assert outs[0].tobytes() == outs[1].tobytes()
    from ddlcore.kernels import reference

    matrix.check_close(outs[0], reference.reduce_ref(xs, op), dtype, op, 2, f"{op} {count}")
    a.close()
    b.close()


def test_sends_and_copies_run_and_the_frames_are_the_python_paths():
    a, b = socket.socketpair()
    x = np.arange(6, dtype=np.float32)
    out = np.zeros(6, np.float32)
    rows = [(SEND, 1, 3, 4, 0, 2, 1, 0, 0), (COPY, 0, 0, 2, 0, 0, 1, 4, 0)]
    assert _run(rows, a.fileno(), [x.ctypes.data, out.ctypes.data, 0], 0) == (0, 2, 0)
    head = b.recv(HEADER.size, socket.MSG_WAITALL)
    assert head == _frame(3, 16)
    assert np.frombuffer(b.recv(16, socket.MSG_WAITALL), np.float32).tolist() == [2, 3, 4, 5]
    assert out.tolist() == [0, 0, 0, 0, 0, 1]


@pytest.mark.parametrize(
    "first",
    [_frame(1, 8), _frame(0, 8, check=CHECK + 2), _frame(0, 12), _frame(0, 8, kind=2)],
    ids=["another tag", "another check word", "another size", "an abort"],
)
def test_stops_before_a_frame_it_does_not_expect_and_leaves_it(first):
    a, b = socket.socketpair()
    b.sendall(first + bytes(HEADER.unpack(first)[-1]))
    out = np.zeros(2, np.float32)
    rows = [(RECV, 1, 0, 2, 0, 0, 1, 0, 0)]
    t0 = time.monotonic()
    assert _run(rows, a.fileno(), [0, out.ctypes.data, 0], 0) == (0, 0, 0)
    assert time.monotonic() - t0 < 0.5  # at once, not after the stop time
    assert a.recv(HEADER.size, socket.MSG_DONTWAIT) == first  # untouched, for Python
    assert out.tolist() == [0, 0]


def test_stops_when_nothing_comes_or_the_eventfd_rings():
    a, b = socket.socketpair()
    rows = [(RECV, 1, 0, 2, 0, 0, 1, 0, 0)]
    out = np.zeros(2, np.float32)
    t0 = time.monotonic()
    assert _run(rows, a.fileno(), [0, out.ctypes.data, 0], 0, stop_s=0.05) == (0, 0, 0)
    assert 0.04 < time.monotonic() - t0 < 2.0
    wake = os.eventfd(0, os.EFD_NONBLOCK)
    threading.Timer(0.1, os.eventfd_write, (wake, 1)).start()
    t0 = time.monotonic()
    assert _run(rows, a.fileno(), [0, out.ctypes.data, 0], 0, stop_s=30, wake=wake) == (0, 0, 0)
    assert time.monotonic() - t0 < 5.0
    os.close(wake)


def test_a_frame_broken_half_way_is_an_error():
    from ddlcore.transports.tcp import _steps

    rows = [(RECV, 1, 0, 4, 0, 0, 1, 0, 0)]
    out = np.zeros(4, np.float32)
    a, b = socket.socketpair()
    b.sendall(_frame(0, 16) + bytes(6))
    b.close()  # EOF inside the payload
    status, step, _ = _run(rows, a.fileno(), [0, out.ctypes.data, 0], 0)
    assert (status, step) == (_steps.BROKEN, 0)
    a, b = socket.socketpair()
    b.sendall(_frame(0, 16) + bytes(6))  # and nothing more: stalled until the deadline
    t0 = time.monotonic()
    status, step, _ = _run(rows, a.fileno(), [0, out.ctypes.data, 0], 0, timeout=0.2)
    assert (status, step) == (_steps.STALLED, 0)
    assert 0.15 < time.monotonic() - t0 < 5.0


def test_a_send_the_socket_takes_part_of_ends_the_run_with_what_it_took():
    from ddlcore.transports.tcp import _steps

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    x = np.arange(1 << 16, dtype=np.float32)  # 256 KB: more than both buffers hold
    rows = [(SEND, 1, 0, x.size, 0, 0, 1, 0, 0), (SEND, 1, 1, 1, 0, 0, 1, 0, 0)]
    status, step, written = _run(rows, a.fileno(), [x.ctypes.data, 0, 0], 0)
    assert (status, step) == (_steps.PARTIAL, 0) and 0 < written < HEADER.size + x.nbytes
    got = b.recv(written, socket.MSG_WAITALL)
    assert got[: HEADER.size] == _frame(0, x.nbytes)
    assert got[HEADER.size :] == x.tobytes()[: written - HEADER.size]
    with pytest.raises(BlockingIOError):  # nothing more: the run stopped there
        b.recv(1, socket.MSG_DONTWAIT)
    a.close()
    b.close()


# --- over real ranks ------------------------------------------------------------------------------
def _count_native():
    """Count the steps each call ran natively."""
    from ddlcore.transports.tcp import steps

    done = []
    real = steps.run

    def counted(*args):
        out = real(*args)
        done.append(out[1] == len(args[0]))  # every step natively
        return out

    patch(steps, "run", counted)
    return done


def _allreduce_cases(size):
    """Every dtype and op (but the integer avg, exact in Python) at counts 0, 1 and primes:
    (what, dtype, op, every rank's input)."""
    for dtype in matrix.DTYPES:
        for count in (0, 1, 7, 1021):
            for op in matrix.OPS:
                if op == "avg" and np.dtype(dtype).kind in "iu":
                    continue
                xs = [matrix.random_input(dtype, count, r, count, op) for r in range(size)]
                yield f"{np.dtype(dtype).name} {op} count={count}", dtype, op, xs


def _bits_and_mixing(rank, size, python_ranks):
    """Every dtype and op at counts 0, 1, primes: natively (unless this rank is in
    ``python_ranks``), the same bits as the Python engine."""
    from ddlcore.kernels import reference

    import ddlcore

    native = _count_native()
    with ddlcore.init(timeout=30) as comm:
        if rank in python_ranks:
            comm._links.run_steps = None
        checked = 0
        for what, dtype, op, xs in _allreduce_cases(size):
            got = comm.allreduce(xs[rank], op=op)
            matrix.check_close(got, reference.reduce_ref(xs, op), dtype, op, size, what)
            checked += 1
            if op == "sum":
                np.testing.assert_array_equal(comm.allgather(xs[rank]), np.concatenate(xs))
        comm.barrier()
        if rank not in python_ranks:
            # Most calls wholly natively (one whose receive is 20 ms late goes on in Python)
            ran = sum(native)
            assert ran > len(native) // 2, f"all steps natively in {ran} of {len(native)} calls"
        else:
            assert not native
        return checked


@pytest.mark.parametrize("nprocs,nchannels", [(2, 1), (3, 1), (4, 1), (2, 3)])
def test_native_steps_give_the_python_engines_results(nprocs, nchannels):
    env = {**TCP, "DDL_NCHANNELS": str(nchannels)}
    checked = run_ranks(_bits_and_mixing, nprocs, (), env=env, timeout=180)
    assert checked[0] > 50 and len(set(checked)) == 1


def test_ranks_running_their_steps_natively_and_in_python_meet():
    run_ranks(_bits_and_mixing, 3, (1,), env=TCP, timeout=180)


def _partial_send(rank, size):
    """A send whose frame the socket takes only in part (tiny buffers, a peer that reads
    late): the channel's sender thread finishes it and the engine waits for it."""
    from ddlcore.transports.tcp import steps

    import ddlcore

    handed = []
    real = steps._send_the_rest

    def counted(*args):
        handed.append(args[-1])
        return real(*args)

    patch(steps, "_send_the_rest", counted)
    with ddlcore.init(timeout=30) as comm:
        comm.barrier()
        for ch in comm._links.pair(1 - rank)._channels:
            ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
            ch.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        x = np.full(16_000, rank + 1.0, np.float32)  # 64 KB messages: native, but not whole
        for i in range(4):
            if rank == 1:
                time.sleep(0.05)  # rank 0's sendmsg finds our receive buffer full
            y = x + i
            # Out of place, then in place: the reduction into the buffer the send still
            # reads waits for the sender thread to finish it.
            got = comm.allreduce(y, out=np.empty_like(y) if i % 2 else y)
            np.testing.assert_array_equal(got, np.full(16_000, 3.0 + 2 * i, np.float32))
        return handed


def test_a_send_left_half_way_is_finished_by_the_sender_thread():
    handed = run_ranks(_partial_send, 2, env=TCP, timeout=120)
    assert handed[0], "no send was handed to the sender thread: the test proves nothing"


def _mismatch(rank, size):
    import ddlcore

    with ddlcore.init(timeout=20) as comm:
        comm.allreduce(np.ones(4, np.float32))
        t0 = time.monotonic()
        with pytest.raises(ddlcore.CollectiveMismatchError) as info:
            comm.allreduce(np.ones(10 + rank, np.float32))
        return str(info.value), time.monotonic() - t0


def test_a_mismatch_is_named_as_on_the_python_path():
    for message, took in run_ranks(_mismatch, 2, env=TCP, timeout=60):
        assert "allreduce #1 (1" in message and "check 0x" in message, message
        assert took < 10, took


# --- the compiled front end on the links -----------------------------------------------------------
def _front_end_on_links(rank, size):
    """Allreduces over TCP skip the Python path (the compiled front end runs the links'
    native steps) and give its bits; what the front end does not take still runs, and a
    mismatch between ranks on the front end is named and breaks the communicator."""
    from ddlcore.kernels import reference

    import ddlcore

    python_calls = count_python_calls()
    native = _count_native()
    with ddlcore.init(timeout=20) as comm:
        front = comm._front
        assert front is not None and front.enabled
        for what, dtype, op, xs in _allreduce_cases(size):
            before = len(python_calls)
            got = comm.allreduce(xs[rank], op=op)
            inplace = xs[rank].copy()
            comm.allreduce(inplace, op=op, out=inplace)
            assert len(python_calls) == before, f"{what}: Python path"
            front.enabled = False
            slow = comm.allreduce(xs[rank], op=op)
            front.enabled = True
            matrix.check_close(got, reference.reduce_ref(xs, op), dtype, op, size, what)
            assert slow.tobytes() == got.tobytes() == inplace.tobytes(), what
        ran = sum(native)  # calls whose steps all ran natively (a late peer: the engine's)
        assert ran > len(native) // 2, f"all steps natively in {ran} of {len(native)} calls"
        # What the front end declines on the links: the Python path runs it.
        before = len(python_calls)
        ints = np.full(5, 2 * rank + 1, np.int32)
        np.testing.assert_array_equal(comm.allreduce(ints, op="avg"), np.full(5, size, np.int32))
        with pytest.raises(ValueError, match="not C-contiguous"):  # the Python path's check
            comm.allreduce(np.arange(12.0)[::2])
        remove = comm.add_before_collective(lambda: None)
        assert not front.enabled
        comm.allreduce(np.ones(3))
        remove()
        assert front.enabled and len(python_calls) == before + 3, python_calls[before:]
        # Past the native runner's messages (64 KB): the front end, then the engine.
        big = np.full(40_000, rank + 1.0)
        np.testing.assert_array_equal(comm.allreduce(big), np.full(40_000, size * (size + 1) / 2))
        before = len(python_calls)
        handle = comm.allreduce_async(np.full(9, float(rank)))
        mid = comm.allreduce(np.ones(3, np.float32))  # behind the queued one: the Python path
        np.testing.assert_array_equal(handle.wait(), np.full(9, size * (size - 1) / 2))
        np.testing.assert_array_equal(mid, np.full(3, size, np.float32))
        assert len(python_calls) == before + 2
        seqs = [e["seq"] for e in comm.flight_record()["entries"]]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs  # none lost
        with pytest.raises(ddlcore.CollectiveMismatchError) as info:
            comm.allreduce(np.ones(10 + rank, np.float32))
        last = comm.flight_record()["entries"][-1]
        assert last["state"] == "failed" and last["count"] == 10 + rank, last
        with pytest.raises(ddlcore.CommunicatorClosedError, match="failed earlier"):
            comm.allreduce(np.ones(3, np.float32))
        return str(info.value)


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_front_end_runs_allreduces_on_the_links(nprocs):
    for rank, message in enumerate(run_ranks(_front_end_on_links, nprocs, env=TCP, timeout=180)):
        assert f"rank {rank}: allreduce #" in message and "check 0x" in message, message
