"""A rank that stops answering (SIGSTOP) is excluded by its heartbeat's silence: every other
rank's collective fails with `PeerFailureError` naming it, long before ``DDL_TIMEOUT``; the
others shrink and go on; when it wakes up it is fenced (`ExcludedError`, never a world of its
own). Only the side holding more than half of the ranks (or half, with rank 0) goes on. A rank
whose Python is stuck in a native call that holds the GIL still answers: it is not excluded."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.harness import run_ranks

# Long enough that a timeout can never pass for the heartbeat's work.
ENV = {"DDL_TIMEOUT": "60"}


def _stop_then_go_on(rank, size, victims):
    """The lowest rank not a victim stops the victims during an allreduce loop; everyone
    reports what the loop raised and when, then what shrink did; the victims are woken up
    after the others shrank (or gave up)."""
    import ddlcore

    comm = ddlcore.init()
    pids = comm.allgather(np.array([os.getpid()], np.int64))
    x = np.arange(1000, dtype=np.float32)
    comm.allreduce(x)
    stopper = min(r for r in range(size) if r not in victims)
    story: dict = {}
    t0 = time.monotonic()
    if rank == stopper:
        for v in victims:
            os.kill(int(pids[v]), signal.SIGSTOP)
    try:
        while True:
            comm.allreduce(x)
    except ddlcore.DDLError as exc:
        story["error"] = (type(exc).__name__, getattr(exc, "peer", None))
        story["seconds"] = time.monotonic() - t0
    try:
        new = comm.shrink()
    except ddlcore.DDLError as exc:
        story["shrink"] = type(exc).__name__
        new = None
    else:
        y = new.allreduce(x)
        story["shrink"] = (new.size, new.member_ids, bool(np.array_equal(y, x * new.size)))
    if rank == stopper:
        for v in victims:
            os.kill(int(pids[v]), signal.SIGCONT)
    if new is not None:
        new.close()
    return story


@pytest.mark.parametrize("victim", [2, 0], ids=["rank-2", "rank-0"])
def test_a_stopped_rank_is_excluded_then_fenced(victim):
    stories = run_ranks(_stop_then_go_on, 4, {victim}, timeout=90, env=ENV)
    members = tuple(r for r in range(4) if r != victim)
    for rank, story in enumerate(stories):
        if rank == victim:
            # Woken up after the others went on: told it was excluded, never its own world.
            assert story["shrink"] == "ExcludedError", story
            continue
        assert story["error"] == ("PeerFailureError", victim), story
        assert story["seconds"] < 20.0, story  # the heartbeat's 1 s, not DDL_TIMEOUT's 60
        assert story["shrink"] == (3, members, True), story


@pytest.mark.parametrize(
    "victims, goes_on",
    [({0, 1}, False), ({2, 3}, True)],
    ids=["without-rank-0-stops", "with-rank-0-goes-on"],
)
def test_only_the_larger_side_goes_on(victims, goes_on):
    stories = run_ranks(_stop_then_go_on, 4, victims, timeout=90, env=ENV)
    for rank, story in enumerate(stories):
        if rank in victims:
            assert story["shrink"] == "ExcludedError", story
        elif goes_on:
            members = tuple(r for r in range(4) if r not in victims)
            assert story["shrink"] == (2, members, True), story
        else:
            assert story["shrink"] == "ExcludedError", story


def _hold_the_gil(rank, size, seconds):
    """Rank 1 sleeps in a native call that keeps the GIL (no Python thread of it can run) while
    the others wait for it in an allreduce."""
    import ctypes

    import ddlcore

    comm = ddlcore.init()
    x = np.full(100, rank + 1.0)
    comm.allreduce(x)
    if rank == 1:
        ctypes.PyDLL(None).usleep(int(seconds * 1e6))  # PyDLL: the GIL stays held
    y = comm.allreduce(x)
    comm.close()
    return float(y[0])


def test_a_rank_holding_the_gil_is_not_excluded():
    assert run_ranks(_hold_the_gil, 3, 3.0, timeout=60, env=ENV) == [6.0, 6.0, 6.0]
