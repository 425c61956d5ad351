"""Three stages over a run of segments, the middle one on a thread of its own, so that segment s's
middle stage overlaps segment s+1's first stage and segment s-1's last stage.

mdring with its host dimensions on the boards runs this way (`Communicator`): the host
reduce-scatter of a segment (first), the rings across hosts on this rank's part of it (middle),
and the host allgather (last). While the network carries segment s, the boards reduce segment
s+1 and spread segment s-1, so only the first segment's reduce-scatter and the last one's
allgather are not hidden behind the links::

    calling thread:  F0  F1  L0  F2  L1  F3  L2  ...       L(n-1)
    helper thread:       M0  M1  M2  M3  ...         M(n-1)

The order on the calling thread is fixed (F0, then F(s), L(s-1) for s = 1 .. n-1, then
L(n-1)), the same on every rank, which stages that synchronise with other ranks (the boards)
need. M(s) starts once F(s) has finished, L(s) once M(s) has.

Failures: the first error of either thread is raised on the calling thread, after ``abort(exc)``
has been called (it must make the other thread's stage fail fast: abort the links, the boards)
and the helper thread has ended.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ddlcore.errors import DDLError, DDLTimeoutError

log = logging.getLogger("ddlcore")

_JOIN_AFTER_ABORT_S = 10.0  # how long the helper may take to notice an abort before we go on


def run(nseg: int, first: Callable[[int], None], middle: Callable[[int], None],
        last: Callable[[int], None], abort: Callable[[BaseException], None], timeout: float,
        name: str = "ddlcore-pipeline") -> None:
    """Run ``first(s)``, ``middle(s)``, ``last(s)`` for s in range(nseg) as described above.

    ``timeout`` bounds each wait of the calling thread for a middle stage (the stages bound
    their own waits too). Raises the first exception either thread met."""
    if nseg < 1:
        return
    firsts = [threading.Event() for _ in range(nseg)]
    middles = [threading.Event() for _ in range(nseg)]
    failed: list[BaseException] = []
    stop = threading.Event()

    def helper() -> None:
        try:
            for s in range(nseg):
                firsts[s].wait()
                if stop.is_set():
                    return
                middle(s)
                middles[s].set()
        except BaseException as exc:  # handed to the calling thread
            failed.append(exc)
        finally:
            for ev in middles:  # wake the calling thread whatever happened
                ev.set()

    def wait_middle(s: int) -> None:
        deadline = time.monotonic() + timeout
        while not middles[s].wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise DDLTimeoutError(f"segment {s} of {nseg} did not cross the network within "
                                      f"{timeout:g} s")
        if failed:
            raise failed[0]

    thread = threading.Thread(target=helper, name=name, daemon=True)
    thread.start()
    try:
        first(0)
        firsts[0].set()
        for s in range(1, nseg):
            first(s)
            firsts[s].set()
            wait_middle(s - 1)
            last(s - 1)
        wait_middle(nseg - 1)
        last(nseg - 1)
    except BaseException as exc:
        err = failed[0] if failed else exc
        stop.set()
        for ev in firsts:
            ev.set()
        try:
            abort(err)
        except Exception:  # best effort: the error below is what counts
            log.debug("abort after a pipeline failure failed", exc_info=True)
        thread.join(_JOIN_AFTER_ABORT_S)
        if thread.is_alive():
            log.warning("%s: the network stage did not end %g s after the abort", name,
                        _JOIN_AFTER_ABORT_S)
        if err is exc:
            raise
        raise err from (exc if isinstance(exc, DDLError) and exc is not err else None)
    thread.join()
