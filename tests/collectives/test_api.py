"""The public contract on real processes: out= and in place, shapes, async handles, barrier,
other array kinds, and argument errors raised before any communication."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.harness import mpiexec_path, require, run_ranks


def _out_and_shapes(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        x = np.arange(6 * size, dtype=np.float32).reshape(2 * size, 3) + rank
        total = sum(
            np.arange(6 * size, dtype=np.float32).reshape(2 * size, 3) + r for r in range(size)
        )
        y = comm.allreduce(x)
        assert y.shape == x.shape and y is not x
        np.testing.assert_array_equal(y, total)
        out = np.empty_like(x)
        assert comm.allreduce(x, out=out) is out
        np.testing.assert_array_equal(out, total)
        z = x.copy()
        assert comm.allreduce(z, op="max", out=z) is z  # in place
        np.testing.assert_array_equal(z, x - rank + size - 1)
        rs = comm.reduce_scatter(x)
        assert rs.shape == (2, 3)
        np.testing.assert_array_equal(rs, total[2 * rank : 2 * rank + 2])
        flat = np.ones(size * 5, np.int32)
        assert comm.reduce_scatter(flat).shape == (5,)
        ag = comm.allgather(np.full((2, 2), rank, np.int64))
        assert ag.shape == (2 * size, 2)
        np.testing.assert_array_equal(ag[:, 0], np.repeat(np.arange(size), 2))
        assert comm.allgather(np.array(rank, np.int8)).shape == (size,)
        b = np.full(7, rank, np.float64)
        assert comm.broadcast(b, root=size - 1) is b
        np.testing.assert_array_equal(b, size - 1)
        comm.barrier()
        assert comm.allreduce(np.ones(3, np.float32), op=ddlcore.Op.AVG).tolist() == [1, 1, 1]
    return True


def _async(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        xs = [np.full(100_000 + i, i + rank, np.float32) for i in range(8)]
        handles = [comm.allreduce_async(x, op="sum") for x in xs]
        mid = comm.allreduce(np.ones(4, np.int32))  # queued behind the async ones, in order
        np.testing.assert_array_equal(mid, size)
        for i, h in reversed(list(enumerate(handles))):
            y = h.wait(timeout=30)
            assert h.done()
            np.testing.assert_array_equal(y, sum(i + r for r in range(size)))
        h = comm.allgather_async(np.array([rank], np.int64))
        np.testing.assert_array_equal(h.wait(), np.arange(size))
        h = comm.broadcast_async(np.full(3, rank, np.int8), root=0)
        np.testing.assert_array_equal(h.wait(), 0)
        h = comm.reduce_scatter_async(np.ones(size * 2, np.float64), op="avg")
        np.testing.assert_array_equal(h.wait(), 1.0)
        # done-callbacks: run once each, after the result is there, also when added late
        seen, called = [], threading.Event()
        h = comm.allreduce_async(np.full(1000, rank, np.int64))
        h.add_done_callback(lambda hd: (seen.append(("early", int(hd.wait(0)[0]))), called.set()))
        h.wait()
        assert called.wait(
            30
        )  # callbacks run right after waiters are woken, like concurrent.futures
        h.add_done_callback(lambda hd: seen.append(("late", int(hd.wait(0)[-1]))))
        total = sum(range(size))
        assert seen == [("early", total), ("late", total)], seen
        h = comm.allreduce_async(np.ones(3, np.float32))
        h.add_done_callback(lambda hd: 1 / 0)  # logged, not raised into the worker
        np.testing.assert_array_equal(h.wait(), size)
    return True


def _torch_tensors(rank, size):
    import torch

    import ddlcore

    with ddlcore.init() as comm:
        t = torch.full((4, 2), float(rank + 1))
        y = comm.allreduce(t)
        assert isinstance(y, torch.Tensor) and y.shape == t.shape
        assert torch.equal(y, torch.full((4, 2), float(sum(range(1, size + 1)))))
        comm.allreduce(t, out=t)  # in place through DLPack: writes the tensor's memory
        assert torch.equal(t, y)
    return True


def _memoryview_input(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        y = comm.allreduce(memoryview(np.full(5, rank, np.int32)))
        np.testing.assert_array_equal(y, sum(range(size)))
    return True


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_out_in_place_and_shapes(nprocs, pools):
    pools.run(_out_and_shapes, nprocs, timeout=60)


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_async_handles(nprocs, pools):
    pools.run(_async, nprocs, timeout=60)


@pytest.mark.parametrize("body", [_out_and_shapes, _async], ids=["shapes", "async"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_api_over_mpi(body, nprocs):
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        require(False, "mpi4py is not installed (pip install 'ddlcore[mpi]')")
    require(mpiexec_path() is not None, "mpiexec is not installed (pip install 'ddlcore[mpi]')")
    run_ranks(body, nprocs, timeout=90, launcher="mpiexec", env={"DDL_TRANSPORT": "mpi"})


def test_torch_cpu_tensors():
    pytest.importorskip("torch")
    run_ranks(_torch_tensors, 2, timeout=60)


def test_buffer_protocol_input(pools):
    pools.run(_memoryview_input, 2, timeout=60)


def _bad_arguments(rank, size):
    import ddlcore

    comm = ddlcore.init()
    x = np.ones(10, np.float32)
    cases = [
        (lambda: comm.allreduce(x, op="median"), ValueError, "op"),
        (lambda: comm.allreduce(x, op=3.5), TypeError, "op"),
        (lambda: comm.allreduce(np.ones(10, np.complex64)), TypeError, "dtype"),
        (lambda: comm.allreduce(np.ones((4, 4), np.float32)[:, 1]), ValueError, "contiguous"),
        (lambda: comm.allreduce(x, out=np.ones(9, np.float32)), ValueError, "out"),
        (lambda: comm.allreduce(x, out=np.ones(10, np.float64)), TypeError, "out"),
        (lambda: comm.allreduce([1.0, 2.0]), TypeError, "x"),
        (lambda: comm.broadcast(x, root=size), ValueError, "root"),
        (lambda: comm.broadcast(x, root=-1), ValueError, "root"),
        (lambda: comm.broadcast(x, root="0"), TypeError, "root"),
        (lambda: comm.reduce_scatter(np.ones(size * 3 + 1, np.float32)), ValueError, "divisible"),
    ]
    if size == 1:
        cases = cases[:-1]  # everything divides by 1
    for call, exc, word in cases:
        try:
            call()
        except exc as err:
            assert word in str(err), f"{exc.__name__} without {word!r}: {err}"
        else:
            raise AssertionError(f"no {exc.__name__} for case about {word}")
    # Nothing was communicated, so the communicator is still in step across ranks.
    np.testing.assert_array_equal(comm.allreduce(np.ones(3, np.int64)), size)
    comm.close()
    with pytest.raises(ddlcore.CommunicatorClosedError):
        comm.allreduce(x)
    return True


@pytest.mark.parametrize("nprocs", [1, 2])
def test_bad_arguments_fail_before_communicating(nprocs, pools):
    pools.run(_bad_arguments, nprocs, timeout=60)


def _single(rank, size):
    import ddlcore

    comm = ddlcore.init()
    assert (comm.rank, comm.size, comm.local_rank, comm.local_size) == (0, 1, 0, 1)
    t0 = time.monotonic()
    np.testing.assert_array_equal(comm.allreduce(np.arange(5.0), op="avg"), np.arange(5.0))
    assert time.monotonic() - t0 < 5
    comm.close()
    return True


def test_world_of_one_without_launcher():
    run_ranks(
        _single,
        1,
        env={v: None for v in ("DDL_RANK", "DDL_SIZE", "DDL_MASTER_ADDR", "DDL_MASTER_PORT")},
        timeout=60,
    )
