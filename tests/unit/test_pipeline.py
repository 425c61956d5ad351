"""`ddlcore.execution.pipeline`: the stage order every rank relies on, overlap of the middle stage, and
failures of either thread raised on the caller after the abort, with the helper ended."""

from __future__ import annotations

import threading
import time

import pytest

from ddlcore.errors import DDLError, DDLTimeoutError
from ddlcore.execution import pipeline


def _recorder():
    log: list[str] = []
    lock = threading.Lock()

    def stage(name):
        def run(s):
            with lock:
                log.append(f"{name}{s}")

        return run

    return log, stage


@pytest.mark.parametrize("nseg", [1, 2, 5])
def test_calling_thread_order_is_fixed_and_middle_follows_first(nseg):
    log, stage = _recorder()
    middle_log, middle = _recorder()
    pipeline.run(nseg, stage("F"), middle("M"), stage("L"), lambda exc: None, 5.0)
    want = ["F0"] + [x for s in range(1, nseg) for x in (f"F{s}", f"L{s - 1}")] + [f"L{nseg - 1}"]
    assert log == want
    assert middle_log == [f"M{s}" for s in range(nseg)]


def test_middle_runs_on_another_thread_while_the_next_first_runs():
    seen = []
    released = threading.Event()

    def first(s):
        if s == 1:  # M0 must be able to run while we are in F1
            assert released.wait(5.0), "the middle stage did not run beside the first"

    def middle(s):
        seen.append(threading.current_thread() is threading.main_thread())
        if s == 0:
            released.set()

    pipeline.run(3, first, middle, lambda s: None, lambda exc: None, 5.0)
    assert seen == [False, False, False]


def test_each_stage_waits_for_the_one_it_depends_on():
    """F(s) ends before M(s) starts; M(s) ends before L(s) starts (stages that take time, so
    that running one early would show in the log)."""
    log, lock = [], threading.Lock()

    def stage(name, pause):
        def run(s):
            with lock:
                log.append((f"{name}{s}", "start"))
            time.sleep(pause)
            with lock:
                log.append((f"{name}{s}", "end"))

        return run

    nseg = 4
    pipeline.run(nseg, stage("F", 0.01), stage("M", 0.02), stage("L", 0.005), lambda exc: None, 5.0)
    at = {entry: i for i, entry in enumerate(log)}
    for s in range(nseg):
        assert at[(f"F{s}", "end")] < at[(f"M{s}", "start")], log
        assert at[(f"M{s}", "end")] < at[(f"L{s}", "start")], log
        if s:
            assert at[(f"M{s - 1}", "end")] < at[(f"M{s}", "start")], log


def test_a_middle_failing_during_a_first_stops_before_the_next_stage():
    calls, failed = [], threading.Event()

    def first(s):
        calls.append(f"F{s}")
        if s == 1:
            assert failed.wait(5.0)

    def middle(s):
        failed.set()
        raise DDLError("rank 0: the network broke")

    with pytest.raises(DDLError, match="network broke"):
        pipeline.run(4, first, middle, lambda s: calls.append(f"L{s}"), lambda exc: None, 5.0)
    assert calls == ["F0", "F1"], calls


def test_an_interrupt_aborts_with_its_name_and_is_raised():
    aborted = []

    def first(s):
        if s == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pipeline.run(3, first, lambda s: None, lambda s: None, aborted.append, 5.0)
    assert len(aborted) == 1 and isinstance(aborted[0], KeyboardInterrupt)


def test_a_failing_middle_is_raised_after_the_abort():
    aborted = []

    def middle(s):
        if s == 1:
            raise DDLError("rank 0: allreduce #3: the network broke")

    with pytest.raises(DDLError, match="network broke"):
        pipeline.run(4, lambda s: None, middle, lambda s: None, aborted.append, 5.0)
    assert len(aborted) == 1 and "network broke" in str(aborted[0])


def test_a_failing_first_aborts_and_ends_the_helper():
    aborted, started, woken = [], threading.Event(), []
    stop = threading.Event()

    def first(s):
        if s == 1:
            assert started.wait(5.0)
            raise DDLError("rank 0: the boards broke")

    def middle(s):  # stuck on the network until the abort arrives
        started.set()
        woken.append(stop.wait(5.0))  # False: it waited out its deadline, never aborted
        if not woken[-1]:
            raise AssertionError("never aborted")
        raise DDLError("rank 0: aborted by our own failure")

    def abort(exc):
        aborted.append(exc)
        stop.set()

    with pytest.raises(DDLError, match="boards broke"):
        pipeline.run(3, first, middle, lambda s: None, abort, 5.0)
    assert woken == [True], woken  # the abort, not a deadline, ended the middle stage
    assert len(aborted) == 1
    assert not [t for t in threading.enumerate() if t.name == "ddlcore-pipeline"]


def test_a_middle_that_never_ends_times_out():
    release = threading.Event()
    with pytest.raises(DDLTimeoutError, match="rank 0: allreduce #7: segment 0 of 2"):
        pipeline.run(
            2,
            lambda s: None,
            lambda s: release.wait(10.0),
            lambda s: None,
            lambda exc: release.set(),
            0.3,
            label="rank 0: allreduce #7",
        )
