"""`WorkDDL`, the backend's work object, alone: completion, errors and its future, whether the
collective finished before or after anyone asked (the Event and the future are made lazily)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from ddlcore.errors import PeerFailureError  # noqa: E402
from ddlcore.handles import Handle  # noqa: E402
from ddlcore.integrations.torch.work import WorkDDL  # noqa: E402

WAIT = 10.0


def _work(outputs):
    return WorkDDL("allreduce", outputs, WAIT)


def test_a_work_finished_before_anyone_asks_gives_its_outputs_everywhere():
    out = [torch.arange(4.0)]
    h = Handle("allreduce", WAIT)
    h._finish(None)
    work = _work(out)._start([h], None)
    assert work.is_completed() and work.is_success() and work.wait()
    future = work.get_future()
    assert future is work.get_future() and future.done()
    assert future.value() is out and work.result() is out


def test_a_future_asked_for_before_the_finish_completes_with_it():
    out = [torch.ones(3)]
    h = Handle("allreduce", WAIT)
    ran = []
    work = _work(out)._start([h], lambda: ran.append(True))
    future = work.get_future()
    assert not future.done() and not work.is_completed()
    waited: list[bool] = []
    waiter = threading.Thread(target=lambda: waited.append(work.wait()))
    waiter.start()
    h._finish(None)
    waiter.join(WAIT)
    assert waited == [True] and ran == [True]
    assert future.wait() is out and work.is_success()


def test_an_error_reaches_wait_and_the_future_as_torch_s_error_type():
    h = Handle("allreduce", WAIT)
    work = _work([torch.zeros(2)])._start([h], None)
    early = work.get_future()
    h._finish(None, PeerFailureError("rank 1: allreduce #3: connection lost"))
    late = _work([torch.zeros(2)])._start([h], None).get_future()
    for future in (early, late):
        with pytest.raises(Exception, match="connection lost"):
            future.wait()
    with pytest.raises(dist.DistBackendError, match="ddl backend, allreduce: .*connection lost"):
        work.wait()
    assert work.is_completed() and not work.is_success()
    assert isinstance(work.exception(), dist.DistBackendError)


@pytest.mark.parametrize("by_hash", [True, False])
def test_each_torch_op_maps_to_its_ddlcore_op_and_the_rest_are_refused(monkeypatch, by_hash):
    """Both ways of reading the op (a ReduceOp's hash where torch makes it the kind's value,
    checked at import; ``.op.value`` otherwise) name the same op, and refuse the same ones."""
    from ddlcore.integrations.torch import work

    assert work._HASH_IS_VALUE  # torch 2.13: one pybind11 call per op, not two
    monkeypatch.setattr(work, "_HASH_IS_VALUE", by_hash)
    opts = dist.AllreduceOptions()
    want = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}
    for name, op in want.items():
        opts.reduceOp = getattr(dist.ReduceOp, name)
        assert work._op(opts, "allreduce") == op
    refused = [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR]
    refused.append(dist._make_nccl_premul_sum(2.0))
    for op in refused:
        opts.reduceOp = op
        with pytest.raises(ValueError, match="is not supported; ddlcore reduces with"):
            work._op(opts, "allreduce")
