"""The conformance checks that apply to the MPI transport, with ranks started by mpiexec.

Left out, by MPI's nature:
* check words (MPI messages have no room for one; size mismatches are still caught, and
  DDL_DEBUG's agreement check covers the rest);
* arbitrary 64-bit tags (``interleaved_tags``): MPI tags are 29 bits, so ours are folded, which is
  exact for the engine's (sequence, slot) tags but not for any two u64 values;
* sends completing before the receiver posts (``ordering_same_tag`` waits for 600 sends before
  receiving): above its eager limit MPI completes a send only once the receive is posted;
* a killed peer: the MPI launcher ends the whole job when a rank dies;
* TCP's channels and sockets.
"""

from __future__ import annotations

import pytest

from tests.harness import mpiexec_path, require, run_ranks
from tests.transports import conformance as conf

TIMEOUT_S = 90.0


def _mpi(fn, nprocs, *args, **kw):
    return run_ranks(fn, nprocs, "mpi", *args, launcher="mpiexec", timeout=TIMEOUT_S, **kw)


@pytest.fixture(autouse=True)
def _needs_mpi():
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        require(False, "mpi4py is not installed (pip install 'ddlcore[mpi]')")
    require(mpiexec_path() is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")


@pytest.mark.parametrize(
    "check",
    [conf.many_outstanding, conf.zero_bytes, conf.both_directions, conf.bad_arguments],
    ids=lambda f: f.__name__,
)
def test_two_rank_checks(check):
    _mpi(check, 2)


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_all_pairs_exchange(nprocs):
    _mpi(conf.all_pairs, nprocs)


def test_sends_do_not_wait_for_the_receiver():
    _mpi(conf.sends_do_not_wait_for_the_receiver, 3)


def test_256_mb_message():
    nbytes = 256 << 20
    (_, crc0), (elapsed, crc1) = _mpi(conf.large_message, 2, nbytes)
    assert crc0 == crc1
    print(f"mpi: 256 MB in {elapsed * 1e3:.0f} ms = {nbytes / elapsed / 1e9:.2f} GB/s")


def test_abort_reaches_the_peer_with_class_and_reason():
    _, seen = _mpi(conf.abort_propagation, 2)
    assert [name for name, _, _ in seen] == [cls.__name__ for cls in conf.ABORT_CODES.values()]
    for (_, message, elapsed), code in zip(seen, conf.ABORT_CODES, strict=True):
        assert message.startswith(f"rank 0 aborted: collective #{code} went wrong"), message
        assert elapsed < 2.0, elapsed


@pytest.mark.parametrize("direct", ["on", "auto"])
def test_device_views(direct):
    """With DDL_GPU_DIRECT=on MPI pairs hand DeviceViews to MPI (mpi4py reads their
    __cuda_array_interface__; host memory behind them here). auto asks the library: the MPICH
    wheel is not CUDA-aware, so its pairs refuse device views and the engine stages."""
    aware = all(_mpi(_cuda_aware, 2))  # asked in the ranks: MPI_Init stays out of pytest
    results = _mpi(conf.device_views, 2, env={"DDL_GPU_DIRECT": direct})
    takes = {flag for flag, _, _ in results}
    assert takes == {direct == "on" or aware}, takes


def _cuda_aware(rank, size, transport):
    from ddlcore.transports.mpi import cuda_aware

    return cuda_aware()


def _thread_levels(rank, size, transport, level):
    """What the transport says of ``level`` before MPI_Init (mpi4py.rc) and after, and what
    ddlcore.init() with DDL_TRANSPORT=mpi does."""
    import mpi4py

    if level is not None:
        mpi4py.rc.thread_level = level
    from ddlcore.transports.mpi import MpiTransport

    before = MpiTransport.is_available()
    from mpi4py import MPI  # MPI_Init, asking for ``level``

    after = MpiTransport.is_available()
    import ddlcore

    try:
        with ddlcore.init() as comm:
            comm.barrier()
        init = "ok"
    except ddlcore.DDLError as exc:
        init = f"{type(exc).__name__}: {exc}"
    return before, after, int(MPI.Query_thread()) == MPI.THREAD_MULTIPLE, init


@pytest.mark.parametrize("level", ["serialized", "multiple"])
def test_thread_level_below_multiple_makes_the_transport_unavailable(level):
    for before, after, multiple, init in _mpi(
        _thread_levels, 2, level, env={"DDL_TRANSPORT": "mpi"}
    ):
        if level == "multiple":
            assert before == after == (True, "") and multiple and init == "ok"
            continue
        assert not before[0] and "thread_level='serialized'" in before[1]
        assert not after[0] and "MPI_THREAD_SERIALIZED" in after[1] and not multiple
        assert init.startswith("TransportUnavailableError: DDL_TRANSPORT=mpi cannot run here")
        assert "needs MPI_THREAD_MULTIPLE" in init and "DDL_TRANSPORT=tcp" in init


def _init_with(rank, size, transport):
    """ddlcore.init()'s outcome, and the class of the pair to the other rank."""
    import ddlcore

    try:
        with ddlcore.init() as comm:
            comm.barrier()
            return "ok", type(comm._links.pair(1 - rank)).__name__
    except ddlcore.DDLError as exc:
        return f"{type(exc).__name__}: {exc}", None


def test_a_thread_level_known_only_after_mpi_init():
    """MPI4PY_RC_THREAD_LEVEL is applied by mpi4py at MPI_Init: the transport is asked again
    once MPI runs. Forced, init says why; with auto across "hosts", tcp carries the job."""
    low = {"MPI4PY_RC_THREAD_LEVEL": "serialized"}
    for outcome, _ in _mpi(_init_with, 2, env={**low, "DDL_TRANSPORT": "mpi"}):
        assert outcome.startswith("TransportUnavailableError: DDL_TRANSPORT=mpi cannot run here")
        assert "MPI_THREAD_SERIALIZED" in outcome
    hosts = {r: {"DDL_HOST_ID": f"host{r}"} for r in range(2)}
    for outcome, pair in _mpi(
        _init_with, 2, env={**low, "DDL_TRANSPORT": "auto:mpi,tcp"}, rank_envs=hosts
    ):
        assert (outcome, pair) == ("ok", "TcpPair")


def _stale_messages(rank, size, name, rounds):
    """Rank 1 sends a message rank 0 never receives, both close, and the next communicator's
    receive of that (source, tag) must get the next communicator's message: MPI reuses a freed
    communicator's context id, and a message left in the old one must not match in the new."""
    import os

    import numpy as np

    import ddlcore

    os.environ.update({"DDL_TRANSPORT": name, "DDL_TIMEOUT": "30"})
    got = []
    for r in range(rounds):
        with ddlcore.init() as comm:
            if rank == 1:
                comm.send(np.full(4, -1.0 - r), 0, tag=7)  # never received
            comm.allreduce(np.ones(1000, np.float32))
            comm.barrier()
        with ddlcore.init() as comm:
            y = np.zeros(4)
            if rank == 1:
                comm.send(np.full(4, float(r)), 0, tag=7)
            elif rank == 0:
                comm.recv(y, 1, tag=7)
            got.append(float(y[0]))
            x = np.arange(1000, dtype=np.float32) + rank
            total = comm.allreduce(x)
            assert np.array_equal(
                total, sum(np.arange(1000, dtype=np.float32) + q for q in range(size))
            )
    return got


def test_a_closed_communicators_messages_stay_in_it():
    rounds = 4
    got = _mpi(_stale_messages, 2, rounds)
    assert got[0] == [float(r) for r in range(rounds)], got[0]


def _large_leftover(rank, size, name):
    """A 4 MB message left unreceived (MPI's rendezvous protocol: its data moves only when the
    sender's MPI makes progress) must not stall the contexts that come after it."""
    import os

    import numpy as np

    import ddlcore

    os.environ.update({"DDL_TRANSPORT": name, "DDL_TIMEOUT": "30"})
    big = np.arange(1 << 20, dtype=np.float32)
    with ddlcore.init() as comm:
        if rank == 1:
            comm._pair(0).isend(memoryview(big).cast("B"), 5)  # never received, never awaited
        comm.barrier()
    sums = []
    for _ in range(3):
        with ddlcore.init() as comm:
            sums.append(float(comm.allreduce(np.full(3, rank + 1.0))[0]))
    return sums


def test_a_large_message_left_behind_stalls_nothing():
    got = _mpi(_large_leftover, 2, env={"MPIR_CVAR_CH4_CMA_ENABLE": "0"})
    assert got == [[3.0, 3.0, 3.0]] * 2, got


def _closed_in_different_orders(rank, size, name):
    """Two communicators open at once, closed by the ranks in different orders: rank 0 still
    sends on one that rank 1 has closed, and that message must reach no later communicator.
    (Rank 1 closes first: rank 0, which serves the store, would wait at close for the others.)"""
    import os

    import numpy as np

    import ddlcore

    os.environ.update({"DDL_TRANSPORT": name, "DDL_TIMEOUT": "30"})
    a = ddlcore.init()
    b = ddlcore.init()
    if rank == 1:
        a.close()
    c = ddlcore.init()
    if rank == 1:
        b.close()
    d = ddlcore.init()
    if rank == 0:
        a.send(np.full(4, -7.0), 1, tag=9)  # rank 1 closed `a` long ago: nobody receives it
        a.close()
        b.close()
    got = []
    for _ in range(3):
        with ddlcore.init() as e:
            y = np.zeros(4)
            if rank == 0:
                e.send(np.full(4, 42.0), 1, tag=9)
            else:
                e.recv(y, 0, tag=9)
            got.append(float(y[0]))
    c.close()
    d.close()
    return got


def test_communicators_closed_in_different_orders_keep_their_messages():
    got = _mpi(_closed_in_different_orders, 2)
    assert got[1] == [42.0] * 3, got[1]
