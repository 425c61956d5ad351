"""send/recv/isend/irecv on real processes: every dtype, sizes 0, 1 and primes, order per tag,
independent tags, receives from any rank, p2p beside collectives, size/dtype mismatches, timeouts and bad arguments.
One world per transport runs every case (spawning ranks is what costs)."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest

from tests.harness import mpiexec_path, require, run_ranks

_DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
_SIZES = (0, 1, 7, 1031, 65537)


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _payload(src, dst, tag, n, dtype):
    """What rank ``src`` sends rank ``dst`` with ``tag``: random, never all zeros, the same
    wherever it is computed."""
    rng = np.random.default_rng([src, dst, tag, n])
    return (rng.integers(1, 100, n) * (1 if np.dtype(dtype).kind == "u" else -1)).astype(dtype)


def _exchange(comm, rank, size):
    """Every rank sends every other rank one message per (dtype, size), all posted first."""
    sends, recvs = [], []
    for i, name in enumerate(_DTYPES):
        dtype = _dtype(name)
        for j, n in enumerate(_SIZES):
            tag = i * len(_SIZES) + j
            for peer in range(size):
                if peer == rank:
                    continue
                sends.append(comm.isend(_payload(rank, peer, tag, n, dtype), peer, tag))
                buf = np.full(n, 3, dtype)
                recvs.append((comm.irecv(buf, peer, tag), buf, peer, tag, n, dtype))
    for handle, buf, peer, tag, n, dtype in recvs:
        assert handle.wait() is buf
        assert handle.done()
        np.testing.assert_array_equal(buf, _payload(peer, rank, tag, n, dtype))
    for handle in sends:
        assert handle.wait() is None


def _ordered(comm, rank, size):
    """Same (pair, tag): in order; different tags: independent (received in reverse)."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    for k in range(20):  # blocking sends of small messages, then the receives
        comm.isend(np.array([k, rank], np.int64), nxt, tag=5)
    got = [comm.recv(np.empty(2, np.int64), prv, tag=5).tolist() for _ in range(20)]
    assert got == [[k, prv] for k in range(20)]
    handles = [
        comm.isend(np.full(1000, t + 1, np.int32), np.int64(nxt), tag=np.int64(100 + t))
        for t in range(5)
    ]
    for t in reversed(range(5)):  # a receive on tag 104 does not wait for tag 100's message
        np.testing.assert_array_equal(comm.recv(np.empty(1000, np.int32), prv, 100 + t), t + 1)
    for h in handles:
        h.wait()


def _mixed_blocking_and_async(comm, rank, size):
    """Blocking and async receives on one (source, tag), from two threads: message order is
    call order, also when a blocking receive completes its own message on an idle channel
    while another thread queues behind it."""
    import threading

    if rank == 0:
        time.sleep(0.3)  # rank 1's blocking receive waits, its async one queues behind
        for k in range(4):
            comm.send(np.array([k], np.int64), 1, tag=6)
    elif rank == 1:
        first = {}
        blocking = threading.Thread(
            target=lambda: first.update(got=comm.recv(np.empty(1, np.int64), 0, tag=6)[0])
        )
        blocking.start()
        time.sleep(0.1)
        second = comm.irecv(np.empty(1, np.int64), 0, tag=6)
        blocking.join(30)
        third = comm.recv(np.empty(1, np.int64), 0, tag=6)  # behind ``second``, not before
        fourth = comm.irecv(np.empty(1, np.int64), 0, tag=6)
        assert [first["got"], second.wait()[0], third[0], fourth.wait()[0]] == [0, 1, 2, 3]


def _beside_collectives(comm, rank, size):
    """p2p posted before collectives and received after them: neither disturbs the other."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    x = _payload(rank, nxt, 0, 4099, np.float32)
    send = comm.isend(x, nxt, tag=0)
    recv = comm.irecv(np.empty(4099, np.float32), prv, tag=0)
    for k in range(3):
        y = comm.allreduce(np.full(4099, rank + k, np.float32))
        np.testing.assert_array_equal(y, sum(r + k for r in range(size)))
    comm.barrier()
    np.testing.assert_array_equal(recv.wait(), _payload(prv, rank, 0, 4099, np.float32))
    send.wait()


def _any_source(comm, rank, size):
    """recv(ANY_SOURCE): rank 0 takes every other rank's messages as they arrive, each
    sender's in its order, and the handle names the sender; a receive naming its source goes
    first on that source's messages."""
    import ddlcore

    k = 5
    if rank != 0:
        for i in range(k):
            comm.send(np.array([rank, i], np.int64), 0, tag=40)
        comm.send(np.array([rank, -1], np.int64), 0, tag=41)
        return
    seen = {r: [] for r in range(1, size)}
    for j in range((size - 1) * k):
        buf = np.empty(2, np.int64)
        if j % 2:
            handle = comm.irecv(buf, ddlcore.ANY_SOURCE, tag=40)
            assert handle.wait() is buf
            assert buf[0] == handle.source
        else:
            assert comm.recv(buf, ddlcore.ANY_SOURCE, tag=40) is buf
        seen[int(buf[0])].append(int(buf[1]))
    assert seen == {r: list(range(k)) for r in range(1, size)}
    named = comm.irecv(np.empty(2, np.int64), 1, tag=41)
    anyone = [comm.irecv(np.empty(2, np.int64), ddlcore.ANY_SOURCE, tag=41) for _ in range(2, size)]
    assert named.wait().tolist() == [1, -1] and named.source == 1
    assert sorted(h.wait()[0] for h in anyone) == list(range(2, size))
    assert sorted(h.source for h in anyone) == list(range(2, size))


def _mismatch(comm, rank, size):
    import ddlcore

    if rank == 0:
        comm.send(np.ones(10, np.float32), 1, tag=9)  # size differs
        comm.send(np.ones(10, np.int32), 1, tag=9)  # dtype differs (same byte count)
        comm.send(np.arange(1, 11, dtype=np.float32), 1, tag=9)  # right: received intact
    elif rank == 1:
        for sent in ("40 bytes (10 x float32)", "40 bytes (10 x int32)"):
            with pytest.raises(ddlcore.CollectiveMismatchError) as err:
                comm.recv(np.empty(11, np.float32), 0, tag=9)
            assert sent in str(err.value) and "rank 0" in str(err.value), err.value
            assert "rank 1" in str(err.value)
        buf = np.empty(10, np.float32)
        comm.recv(buf, 0, tag=9)
        np.testing.assert_array_equal(buf, np.arange(1, 11))


def _timeout(comm, rank, size):
    """A receive with no sender fails after DDL_TIMEOUT; the message sent later is not lost:
    the next receive on that (source, tag) gets it. Last, with no collective after it (the
    other ranks would wait out their own timeout meanwhile)."""
    import ddlcore

    if rank == 1:
        start = time.monotonic()
        from_anyone = comm.irecv(np.empty(3, np.int64), ddlcore.ANY_SOURCE, tag=79)
        with pytest.raises(ddlcore.DDLTimeoutError) as err:
            comm.recv(np.empty(3, np.int64), 0, tag=77)
        assert time.monotonic() - start < comm.timeout + 3
        assert "rank 0" in str(err.value) and "tag 77" in str(err.value), err.value
        with pytest.raises(ddlcore.DDLTimeoutError, match="any rank with tag 79"):
            from_anyone.wait()
        comm.send(np.ones(1, np.int8), 0, tag=78)  # now send it
        assert comm.recv(np.empty(3, np.int64), 0, tag=77).tolist() == [4, 5, 6]
    elif rank == 0:
        for attempt in range(3):  # rank 1 takes DDL_TIMEOUT to get there: retry
            try:
                comm.recv(np.empty(1, np.int8), 1, tag=78)
                break
            except ddlcore.DDLTimeoutError:
                assert attempt < 2
        comm.send(np.array([4, 5, 6], np.int64), 1, tag=77)


def _bad_arguments(comm, rank, size):
    x = np.ones(3, np.float32)
    for dest, exc in ((rank, ValueError), (size, ValueError), (-1, ValueError), (1.0, TypeError)):
        with pytest.raises(exc, match="dest"):
            comm.send(x, dest)
    with pytest.raises(ValueError, match="source"):
        comm.recv(x, rank)
    with pytest.raises(ValueError, match="source"):
        comm.recv(x, -2)
    with pytest.raises(ValueError, match="tag"):
        comm.isend(x, (rank + 1) % size, tag=1 << 24)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.ones(3, np.float32)
        ro.flags.writeable = False
        comm.irecv(ro, (rank + 1) % size)


def _p2p_job(rank, size, with_timeout=False):
    import ddlcore

    with ddlcore.init() as comm:
        _exchange(comm, rank, size)
        _ordered(comm, rank, size)
        _mixed_blocking_and_async(comm, rank, size)
        _any_source(comm, rank, size)
        _beside_collectives(comm, rank, size)
        _mismatch(comm, rank, size)
        _bad_arguments(comm, rank, size)
        if with_timeout:
            _timeout(comm, rank, size)
    with pytest.raises(ddlcore.CommunicatorClosedError):
        comm.send(np.ones(1), (rank + 1) % size)
    return True


@pytest.mark.parametrize(("transport", "nprocs"), [("tcp", 3), ("shm", 4), ("ucx", 2)])
def test_p2p(transport, nprocs):
    """Every case; the timeout (which costs DDL_TIMEOUT) over tcp only."""
    env = {"DDL_TRANSPORT": transport, "DDL_TIMEOUT": "3"}
    results = run_ranks(_p2p_job, nprocs, transport == "tcp", env=env, timeout=90)
    assert results == [True] * nprocs


def test_p2p_mpi():
    require(mpiexec_path() is not None, "mpiexec is not installed")
    env = {"DDL_TRANSPORT": "mpi", "DDL_TIMEOUT": "3"}
    assert run_ranks(_p2p_job, 2, env=env, timeout=90, launcher="mpiexec") == [True, True]


def _peer_dies(rank, size):
    import os

    import ddlcore

    comm = ddlcore.init()
    comm.barrier()
    if rank == 1:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(ddlcore.PeerFailureError) as err:
        comm.recv(np.empty(4, np.float32), 1, tag=2)
    assert "rank 1" in str(err.value), err.value
    assert time.monotonic() - start < 10, "a dead peer must not cost the whole DDL_TIMEOUT"
    return True


def test_recv_from_a_dead_peer():
    env = {"DDL_TRANSPORT": "tcp", "DDL_TIMEOUT": "20"}
    assert run_ranks(_peer_dies, 2, env=env, timeout=60, may_die=[1])[0] is True


def _device_job(rank, size):
    """Device arrays (Numba's simulator) go through host memory both ways; a device send may
    be received into host memory and the reverse."""
    from numba import cuda

    import ddlcore
    from tests.collectives.matrix import few_simulator_threads

    few_simulator_threads()
    peer = 1 - rank
    with ddlcore.init() as comm:
        for i, name in enumerate(_DTYPES):
            dtype = _dtype(name)
            for n in (0, 1, 1031):
                tag = 10 * i + (n % 7)
                send = comm.isend(cuda.to_device(_payload(rank, peer, tag, n, dtype)), peer, tag)
                into = cuda.to_device(np.full(n, 3, dtype)) if rank else np.full(n, 3, dtype)
                got = comm.recv(into, peer, tag)
                assert got is into
                host = into.copy_to_host() if rank else into
                np.testing.assert_array_equal(host, _payload(peer, rank, tag, n, dtype))
                send.wait()
    return True


def test_p2p_device_arrays():
    require(importlib.util.find_spec("numba") is not None, "numba is not installed")
    env = {"DDL_TRANSPORT": "shm", "DDL_TIMEOUT": "10", "NUMBA_ENABLE_CUDASIM": "1"}
    assert run_ranks(_device_job, 2, env=env, timeout=90) == [True, True]
