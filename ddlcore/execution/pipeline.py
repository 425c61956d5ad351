"""Three stages over a run of segments, the middle one on a thread of its own, so that segment s's
middle stage overlaps segment s+1's first stage and segment s-1's last stage.

mdring with its host dimensions on the boards runs this way (`ddlcore.execution.paths.host_staged`): the
host reduce-scatter of a segment (first), the rings across hosts on this rank's part of it
(middle), and the host allgather (last). While the network carries segment s, the boards reduce segment
s+1 and spread segment s-1, so only the first segment's reduce-scatter and the last one's
allgather are not hidden behind the links::

    calling thread:  F0  F1  L0  F2  L1  F3  L2  ...       L(n-1)
    helper thread:       M0  M1  M2  M3  ...         M(n-1)

The order on the calling thread is fixed (F0, then F(s), L(s-1) for s = 1 .. n-1, then
L(n-1)), the same on every rank, which stages that synchronise with other ranks (the boards)
need. M(s) starts once F(s) has finished, L(s) once M(s) has.

Failures: the first error of either thread is raised on the calling thread, after ``abort(exc)``
has been called (it must make the other thread's stage fail fast: abort the links, the boards)
and the helper thread has ended (its stages' waits end by their own deadlines; we wait that
long). A failed middle stage is seen before the calling thread starts its next stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ddlcore.errors import DDLTimeoutError

log = logging.getLogger("ddlcore")


def run(
    nseg: int,
    first: Callable[[int], None],
    middle: Callable[[int], None],
    last: Callable[[int], None],
    abort: Callable[[BaseException], None],
    timeout: float,
    name: str = "ddlcore-pipeline",
    label: str = "pipeline",
) -> None:
    """Run ``first(s)``, ``middle(s)``, ``last(s)`` for s in range(nseg) as described above.

    ``timeout`` bounds the calling thread's waits for the middle stages, all of them together
    (the stages bound their own waits too), and, after a failure, the wait for the helper to
    end. Raises the first exception either thread met; ``label`` (e.g. "rank 0: allreduce #3")
    starts the message of our own timeout."""
    if nseg < 1:
        return
    deadline = time.monotonic() + timeout
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
        while not middles[s].wait(min(1.0, max(0.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise DDLTimeoutError(
                    f"{label}: segment {s} of {nseg} had not crossed the "
                    f"network {timeout:g} s after the call began"
                )
        helper_failed()

    def helper_failed() -> None:
        if failed:
            raise failed[0]

    thread = threading.Thread(target=helper, name=name, daemon=True)
    thread.start()
    try:
        first(0)
        firsts[0].set()
        for s in range(1, nseg):
            helper_failed()
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
        thread.join(max(1.0, deadline - time.monotonic()) + 1.0)
        if thread.is_alive():  # a stage that ignores its deadline: a bug, say so
            log.error("%s: %s: the middle stage did not end after the abort", name, label)
        if err is exc:
            raise
        raise err from exc
    thread.join()
