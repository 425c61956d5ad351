"""The in-order executor behind async handles: order, who runs a job, holding the worker."""

from __future__ import annotations

import threading

import pytest

from ddlcore.errors import CommunicatorClosedError, DDLTimeoutError
from ddlcore.handles import Executor, Handle

WAIT = 10.0  # seconds any step here may take before the test fails instead of hanging


def recorder() -> tuple[list[tuple[int, int]], object]:
    """A job factory whose jobs append (their seq, the running thread's ident)."""
    ran: list[tuple[int, int]] = []

    def job(seq: int) -> int:
        ran.append((seq, threading.get_ident()))
        return seq * 10

    return ran, job


def handle(label: str = "job") -> Handle:
    return Handle(label, WAIT)


@pytest.fixture
def executor():
    ex = Executor("test-executor")
    yield ex
    ex.close(WAIT)


def test_jobs_run_in_submission_order_with_their_results(executor):
    ran, job = recorder()
    handles = [executor.submit(job, handle()) for _ in range(50)]
    assert [h.wait() for h in handles] == [10 * s for s in range(50)]
    assert [seq for seq, _ in ran] == list(range(50))


def test_a_held_job_runs_at_once_on_this_thread_when_the_executor_is_idle(executor):
    ran, job = recorder()
    executor.submit(job, handle()).wait()  # the worker exists from here on
    # wait() returns once the job's result is set; the worker dequeues it just after
    assert executor.drain(WAIT)
    with executor.hold():
        h = executor.submit(job, handle())
        assert h.done() and ran[-1] == (1, threading.get_ident())
        assert h.wait(0) == 10


def test_an_unheld_job_is_the_worker_s_unless_its_waiter_comes_first(executor):
    gate = threading.Event()
    ran, job = recorder()
    executor.submit(lambda seq: gate.wait(WAIT), handle("first"))
    second = executor.submit(job, handle("second"))
    gate.set()
    assert second.wait() == 10  # run by whichever thread took it first
    assert [seq for seq, _ in ran] == [1]


def test_a_held_job_nobody_waits_for_goes_to_the_worker_at_the_block_end(executor):
    gate = threading.Event()
    ran, job = recorder()
    first = executor.submit(lambda seq: gate.wait(WAIT), handle("first"))
    with executor.hold():
        h = executor.submit(job, handle())  # queued behind "first", the worker not woken
    gate.set()
    assert first.wait(WAIT) is True
    assert h.wait(WAIT) == 10  # a timeout: no stealing, only the worker may run it
    assert ran[0][1] != threading.get_ident()


def test_wait_does_not_run_a_job_that_is_not_next(executor):
    gate = threading.Event()
    ran, job = recorder()
    first = executor.submit(lambda seq: gate.wait(WAIT), handle("first"))
    with executor.hold():
        second = executor.submit(job, handle("second"))
        second.run_here()  # "first" is ahead of it: nothing happens
        assert not second.done() and not ran
        gate.set()
        assert second.wait(WAIT) == 10
    assert first.wait(0) is True
    assert ran == [(1, ran[0][1])] and ran[0][1] != threading.get_ident()


def test_a_held_job_behind_an_inline_call_is_run_by_the_worker(executor):
    gate, entered = threading.Event(), threading.Event()
    ran, job = recorder()

    def inline(seq: int) -> str:
        entered.set()
        gate.wait(WAIT)
        return "inline"

    other = threading.Thread(target=lambda: executor.run_inline(inline, handle))
    other.start()
    assert entered.wait(WAIT)
    with executor.hold():
        h = executor.submit(job, handle())
        h.run_here()  # the inline call holds the executor: the worker is woken instead
        assert not h.done()
        gate.set()
        assert h.wait(WAIT) == 10
    other.join(WAIT)
    assert ran[0][0] == 1 and ran[0][1] != threading.get_ident()


def test_a_stolen_job_s_error_and_callbacks_reach_the_waiter(executor):
    seen = []

    def fails(seq: int) -> None:
        raise ValueError(f"job {seq} failed")

    with executor.hold():
        h = executor.submit(fails, handle())
        h.add_done_callback(lambda done: seen.append(threading.get_ident()))
        with pytest.raises(ValueError, match="job 0 failed"):
            h.wait()
    assert seen == [threading.get_ident()]
    with pytest.raises(ValueError):
        h.wait(0)  # the same error again, not a second run


def test_wait_with_a_timeout_never_runs_the_job_itself(executor):
    gate = threading.Event()
    executor.submit(lambda seq: gate.wait(WAIT), handle("first"))
    ran, job = recorder()
    with executor.hold():
        h = executor.submit(job, handle("second"))
        with pytest.raises(DDLTimeoutError, match="second not complete"):
            h.wait(0.05)
        gate.set()
    assert h.wait(WAIT) == 10


def test_many_threads_waiting_keep_the_order(executor):
    ran, job = recorder()
    handles: list[Handle] = []
    lock = threading.Lock()

    def caller() -> None:
        for _ in range(100):
            with executor.hold():
                with lock:  # submission order is the order handles are listed in
                    h = executor.submit(job, handle())
                    handles.append(h)
                h.wait()

    threads = [threading.Thread(target=caller) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    assert [seq for seq, _ in ran] == list(range(400))
    assert [h.wait(0) for h in handles] == [10 * s for s in range(400)]


def test_drain_then_close_refuses_new_jobs(executor):
    ran, job = recorder()
    for _ in range(5):
        executor.submit(job, handle())
    assert executor.drain(WAIT)
    assert executor.pending() == 0 and len(ran) == 5
    executor.close(WAIT)
    with pytest.raises(CommunicatorClosedError, match="closed"):
        executor.submit(job, handle("late"))


def test_a_closed_executor_refuses_inline_calls_with_the_handle_s_label(executor):
    executor.close(WAIT)

    def make() -> Handle:
        executor.pending()  # as the communicator's wait budget does: takes the lock
        return handle("late inline")

    with pytest.raises(CommunicatorClosedError, match="late inline"):
        executor.run_inline(lambda seq: seq, make)


def test_waiters_blocked_before_the_finish_are_woken_by_it():
    """Threads that block on a handle before it finishes (the handle makes its Event only
    then) all see the result; a wait that times out first leaves the handle usable."""
    h = handle()
    with pytest.raises(DDLTimeoutError):
        h.wait(0.01)
    got: list[object] = []
    waiters = [threading.Thread(target=lambda: got.append(h.wait(WAIT))) for _ in range(4)]
    for t in waiters:
        t.start()
    assert not h.done()
    h._finish(42)
    for t in waiters:
        t.join(WAIT)
    assert got == [42] * 4 and h.done() and h.wait(0) == 42
