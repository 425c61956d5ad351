"""The compiled front end of one-host communicators (``ddlcore.execution._frontend``): it takes
allreduce, broadcast and barrier on plain NumPy arrays in one native step, and must be the
Python path exactly -- same results (bit for bit), same check words and sequence numbers (ranks
on different paths meet), same errors, same flight record -- and decline, with nothing taken,
whatever it does not handle. The collective matrix (test_collectives, shm) runs through it too;
this file shows that it ran, and the edges."""

from __future__ import annotations

import array
import time

import numpy as np
import pytest

from tests.collectives import matrix
from tests.harness import count_python_calls, run_ranks

SHM = {"DDL_TRANSPORT": "shm"}
TIMEOUT_S = 20.0


def _same_as_python_path(rank, size):
    """Every dtype and op at counts 0, 1, primes and past the slots (direct reads), out of
    place, into out= and in place, plus broadcast and barrier: all through the front end, and
    the same bits as the Python path (the front end switched off)."""
    from ddlcore.kernels import reference

    import ddlcore

    python_calls = count_python_calls()
    with ddlcore.init() as comm:
        front = comm._front
        assert front is not None and front.enabled
        checked = 0
        for dtype in matrix.DTYPES:
            isz = np.dtype(dtype).itemsize
            # Past the slots only where direct reads work (else the schedules run it).
            past = [comm._host.slots_max // isz + 5] if comm._host.direct else []
            for count in (0, 1, 7, 1021, *past):
                for op in matrix.OPS:
                    if op == "avg" and np.dtype(dtype).kind in "iu":
                        continue  # the exact integer avg runs in Python (int_avg)
                    xs = [matrix.random_input(dtype, count, r, count, op) for r in range(size)]
                    x = xs[rank]
                    before = len(python_calls)
                    got = comm.allreduce(x, op=op)
                    into = np.empty_like(x)
                    assert comm.allreduce(x, op=op, out=into) is into
                    inplace = x.copy()
                    comm.allreduce(inplace, op=op, out=inplace)
                    assert len(python_calls) == before, f"{dtype} {op} {count}: Python path"
                    front.enabled = False
                    slow = comm.allreduce(x, op=op)
                    front.enabled = True
                    what = f"{np.dtype(dtype).name} {op} count={count}"
                    matrix.check_close(got, reference.reduce_ref(xs, op), dtype, op, size, what)
                    for other in (into, inplace, slow):
                        assert other.tobytes() == got.tobytes(), what
                    checked += 1
                before = len(python_calls)
                b = xs[rank].copy()
                assert comm.broadcast(b, root=size - 1) is b
                np.testing.assert_array_equal(b, xs[size - 1])
                assert len(python_calls) == before, f"{dtype} broadcast: Python path"
        before = len(python_calls)
        comm.barrier()
        assert len(python_calls) == before
    return checked


@pytest.mark.parametrize("nprocs", [2, 3])
def test_takes_the_common_calls_with_the_python_paths_bits(nprocs, pools):
    checked = pools.run(_same_as_python_path, nprocs, env=SHM, timeout=240)
    assert checked[0] > 100 and len(set(checked)) == 1


def _mixed_paths(rank, size):
    """Rank 0 on the front end (NumPy), the others on the Python path (array.array): they meet
    at the same sync points with the same check words and sequence numbers."""
    import ddlcore

    python_calls = count_python_calls()
    with ddlcore.init(timeout=TIMEOUT_S) as comm:
        vals = [float(rank + 1 + i) for i in range(11)]
        x = np.array(vals, np.float32) if rank == 0 else array.array("f", vals)
        got = np.asarray(comm.allreduce(x, op="max"))
        np.testing.assert_array_equal(got, np.array(vals, np.float32) + size - 1 - rank)
        b = np.zeros(5, np.int64) if rank == 0 else array.array("q", [rank] * 5)
        comm.broadcast(b, root=1)
        assert list(b) == [1] * 5
        comm.barrier()
        # Rank 0 took the front end for all three, the others the Python path (not barrier's).
        assert len(python_calls) == (0 if rank == 0 else 2), python_calls
        # A mismatch across the paths: named on both sides, with the same sequence number.
        n = 10 if rank == 0 else 12
        y = np.ones(n, np.float32) if rank == 0 else array.array("f", [1.0] * n)
        try:
            comm.allreduce(y)
        except ddlcore.CollectiveMismatchError as exc:
            message = str(exc)
        else:
            raise AssertionError("different counts were not detected")
        # Broken now, whichever path it took: both refuse the next call, naming the failure.
        for call in (lambda: comm.allreduce(np.ones(3, np.float32)), comm.barrier):
            try:
                call()
            except ddlcore.CommunicatorClosedError as exc:
                assert "failed earlier" in str(exc), exc
            else:
                raise AssertionError("a broken communicator ran a collective")
        return message


def test_ranks_on_different_paths_agree_and_disagree_alike():
    messages = run_ranks(_mixed_paths, 2, env=SHM, timeout=60)
    for rank, message in enumerate(messages):
        assert f"rank {rank}: allreduce #3 (" in message, message
        assert "allreduce(10 x float32, sum)" in message, message
        assert "allreduce(12 x float32, sum)" in message, message


def _links_told(rank, size):
    """A failure on the front end breaks the links too, as after the Python path's failed
    board step: a receive afterwards fails at once instead of waiting out DDL_TIMEOUT."""
    import ddlcore

    with ddlcore.init(timeout=TIMEOUT_S) as comm:
        comm.allreduce(np.ones(4, np.float32))
        with pytest.raises(ddlcore.CollectiveMismatchError):
            comm.allreduce(np.ones(10 + rank, np.float32))  # both on the front end
        t0 = time.monotonic()
        with pytest.raises(ddlcore.DDLError):
            comm.recv(np.empty(1, np.float32), 1 - rank)
        return time.monotonic() - t0


def test_a_failure_on_the_front_end_tells_the_links():
    for elapsed in run_ranks(_links_told, 2, env=SHM, timeout=60):
        assert elapsed < TIMEOUT_S / 4, elapsed


def _declined(rank, size):
    """What the front end does not take goes to the Python path with nothing taken: its
    argument errors, the integer avg, other array types, queued async calls, hooks."""
    import ddlcore

    python_calls = count_python_calls()
    with ddlcore.init() as comm:
        x = np.arange(12, dtype=np.float32) + rank
        bad = [
            (lambda: comm.allreduce(x[::2]), ValueError),  # not contiguous
            (lambda: comm.allreduce(x, out=np.empty(12, np.float64)), TypeError),
            (lambda: comm.allreduce(x, out=np.empty(11, np.float32)), ValueError),
            (lambda: comm.allreduce(x, op="median"), ValueError),
            (lambda: comm.allreduce(np.ones(3, np.complex64)), TypeError),
            (lambda: comm.broadcast(x, root=size), ValueError),
            (lambda: comm.broadcast(np.frombuffer(b"abcd", np.uint8)), ValueError),
        ]
        for call, error in bad:
            with pytest.raises(error):
                call()
        assert len(python_calls) == len(bad)  # each refused by the Python path's checks
        # The Python path's cases, each still right.
        ints = np.full(5, 2 * rank + 1, np.int32)
        np.testing.assert_array_equal(comm.allreduce(ints, op="avg"), np.full(5, size, np.int32))
        np.testing.assert_array_equal(
            comm.allreduce(x, op="SUM"), sum(np.arange(12) + r for r in range(size))
        )
        np.testing.assert_array_equal(
            comm.allreduce(x.reshape(3, 4), op="max").ravel(), x - rank + size - 1
        )
        hooked = []
        remove = comm.add_before_collective(lambda: hooked.append(1))
        comm.allreduce(x)
        comm.barrier()
        assert hooked == [1, 1] and not comm._front.enabled
        remove()
        assert comm._front.enabled
        handle = comm.allreduce_async(np.full(200_000, rank, np.float32))
        mid = comm.allreduce(np.ones(3, np.float32))  # behind the queued one
        np.testing.assert_array_equal(handle.wait(), np.full(200_000, size * (size - 1) / 2))
        np.testing.assert_array_equal(mid, np.full(3, size, np.float32))
        record = comm.flight_record()["entries"]
        seqs = [e["seq"] for e in record]
        # No sequence number lost to a declined call: the calls that ran, one after another.
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    return [
        (e["seq"], e["collective"], e["count"], e["dtype"], e["op"], e["state"]) for e in record
    ]


def test_declines_what_it_does_not_handle_with_nothing_taken(pools):
    records = pools.run(_declined, 3, env=SHM, timeout=120)
    assert records[0] == records[1] == records[2]
    assert all(state == "completed" for *_, state in records[0])
    assert any(r[1:] == ("allreduce", 12, "float32", "sum", "completed") for r in records[0])
    assert any(r[1:] == ("barrier", 0, None, None, "completed") for r in records[0])


def _failure_recorded(rank, size):
    """A peer that exits during a front-end call: PeerFailureError naming it, the flight record
    marks the call failed, and the communicator refuses the next call."""
    import os

    import ddlcore

    comm = ddlcore.init(timeout=TIMEOUT_S)
    comm.barrier()
    if rank == 1:
        time.sleep(0.2)
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(1000, np.float32))
    except ddlcore.PeerFailureError as exc:
        elapsed, message = time.monotonic() - t0, str(exc)
    else:
        raise AssertionError("the dead rank was not noticed")
    last = comm.flight_record()["entries"][-1]
    try:
        comm.barrier()
    except ddlcore.CommunicatorClosedError:
        pass
    else:
        raise AssertionError("a broken communicator ran a barrier")
    return message, elapsed, last["collective"], last["state"], last["seq"]


def test_a_failure_on_the_front_end_is_named_recorded_and_breaks_the_communicator():
    results = run_ranks(_failure_recorded, 2, may_die={1}, env=SHM, timeout=60)
    message, elapsed, collective, state, seq = results[0]
    assert elapsed < TIMEOUT_S / 2, (elapsed, message)
    assert "rank 0: allreduce #1 (1000 x float32, sum)" in message and "rank 1" in message
    assert (collective, state, seq) == ("allreduce", "failed", 1)


def _debug_has_none(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        assert comm._front is None
        return float(comm.allreduce(np.ones(1, np.float32))[0])


def test_ddl_debug_compares_every_call_in_python(pools):
    assert pools.run(_debug_has_none, 2, env={**SHM, "DDL_DEBUG": "1"}, timeout=60) == [2.0] * 2
