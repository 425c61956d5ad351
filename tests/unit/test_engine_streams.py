"""The engine's streams (a schedule with parts): which failure a call reports when one stream
fails and the abort it sends wakes the others (their errors only echo it)."""

from __future__ import annotations

import threading
import time

import numpy as np

from ddlcore.algorithms.schedule import Buf, Kind, Part, Schedule, Step
from ddlcore.errors import DDLError, DDLTimeoutError, PeerFailureError
from ddlcore.execution import engine


class _Request:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: DDLError | None = None

    def fail(self, error: DDLError) -> None:
        self.error = error
        self.done.set()

    def test(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise DDLTimeoutError("no message")
        if self.error is not None:
            raise self.error


class _Links:
    """Rank 0's links: the receive from rank 2 fails after a moment (rank 2 died); the one
    from rank 1 never completes until an abort fails every pending request."""

    def __init__(self) -> None:
        self.pending: list[_Request] = []
        self.lock = threading.Lock()

    def pair(self, peer: int):
        links = self

        class _Pair:
            def irecv(self, view, tag, check):
                req = _Request()
                with links.lock:
                    links.pending.append(req)
                if peer == 2:
                    threading.Timer(
                        0.2, req.fail, [PeerFailureError("rank 2 died mid-message")]
                    ).start()
                return req

            def isend(self, view, tag, check):
                req = _Request()
                req.done.set()
                return req

        return _Pair()

    def abort(self, code: int, reason: str) -> None:
        with self.lock:
            pending, self.pending = self.pending, []
        for req in pending:
            if not req.done.is_set():
                req.fail(PeerFailureError(f"rank 0 aborted: {reason}"))
        # Telling the peers takes a while (a real transport writes to each of them): the
        # streams woken above fail, and record their echo, before the aborting one returns.
        time.sleep(0.05)


def test_the_stream_that_failed_first_is_the_one_reported():
    steps = (
        Step(Kind.RECV, 1, 0, 4, dst=Buf.OUTPUT, dst_off=0, part=0),
        Step(Kind.RECV, 2, 0, 4, dst=Buf.OUTPUT, dst_off=4, part=1),
    )
    sched = Schedule("allreduce", "mdring", 0, 3, 8, 8, steps, parts=(Part(0), Part(1)))
    out = np.zeros(8, np.float32)
    coll = engine.Collective(5, 0, 4, 0, None, "allreduce #5 (8 x float32, sum)")
    for _ in range(20):  # the woken stream may record its echo first: order must not matter
        try:
            engine.run(
                sched,
                coll,
                {Buf.INPUT: engine.Region.of(out), Buf.OUTPUT: engine.Region.of(out)},
                _Links(),
                engine.StagingPool(),
                4,
                10.0,
            )
        except PeerFailureError as exc:
            assert "rank 2 died mid-message" in str(exc) and "step 2 of 2" in str(exc), str(exc)
        else:
            raise AssertionError("the failed receive was not reported")
