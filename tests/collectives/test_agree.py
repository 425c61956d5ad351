"""`Communicator.agree`: the fault-tolerant AND, between real processes over the control plane.
Every rank that returns gets the same value, in step call by call; it works on a communicator
that failed or was revoked; a rank dead before or during the call (SIGKILL at a random moment,
the coordinator after telling only one rank, rank 0 which serves the store) is named in
`failed_ranks` on every survivor and its flag does not count; a rank that never calls agree is
a named timeout, not a hang. The protocol itself, against every interleaving of a simulated
network, is tests/unit/test_agree.py."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import numpy as np
import pytest

from tests.harness import run_ranks

TIMEOUT_S = 20.0
_ENV = {"DDL_TIMEOUT": str(TIMEOUT_S)}


def _flags(rank: int, i: int) -> bool:
    return random.Random(f"{rank}/{i}").random() < 0.85


def revoked_by(comm, revoker: int) -> None:
    """``revoker`` revokes ``comm``; the other ranks see it fail an allreduce."""
    import ddlcore

    if comm.rank == revoker:
        comm.revoke()
        return
    try:
        comm.allreduce(np.ones(10, np.float32))
    except ddlcore.CommunicatorRevokedError:
        pass


def _values(rank, size):
    import ddlcore

    comm = ddlcore.init()
    out = [comm.agree(True), comm.agree(rank != size - 1), comm.agree(rank != 0)]
    out += [comm.agree(_flags(rank, i)) for i in range(40)]
    child = comm.split(rank % 2)
    out.append(child.agree(rank != 1))  # the child's own first call
    child.close()
    out.append(comm.agree(True))
    revoked_by(comm, 1)  # a revoked communicator still agrees (the plane is not its links)
    out.append(comm.agree(True))
    out.append(comm.failed_ranks)
    comm.close()
    return out


def test_agree_is_the_and_of_every_flag_on_every_rank(pools):
    size = 4
    results = pools.run(_values, size, env=_ENV, timeout=120)
    flags = [all(_flags(r, i) for r in range(size)) for i in range(40)]
    child_flags = [True, False]  # child of even ranks (0, 2); odd ranks (1, 3): rank 1 says False
    for rank, got in enumerate(results):
        assert got[:3] == [True, False, False], (rank, got[:3])
        assert got[3:43] == flags, rank
        assert got[43] == child_flags[rank % 2], (rank, got[43])
        assert got[44:] == [True, True, ()], (rank, got[44:])


def _after_a_death(rank, size, victim):
    """The victim exits between two allreduces; the survivors' second one fails, and they
    agree that the step did not complete."""
    import ddlcore

    comm = ddlcore.init()
    x = np.arange(1000, dtype=np.float32)
    comm.allreduce(x)
    if rank == victim:
        os._exit(0)
    try:
        comm.allreduce(x)
        completed = True
    except ddlcore.PeerFailureError:
        completed = False
    t0 = time.monotonic()
    committed = comm.agree(completed)
    seconds = time.monotonic() - t0
    later = [comm.agree(True) for _ in range(5)]
    return committed, comm.failed_ranks, later, seconds


@pytest.mark.parametrize("victim", [0, 2])
def test_survivors_of_a_death_agree_and_name_it(victim):
    """Rank 0 (which serves the store, so nothing here may need it) or another dies."""
    results = run_ranks(_after_a_death, 4, victim, env=_ENV, timeout=120, may_die={victim})
    for rank, got in enumerate(results):
        if rank == victim:
            continue
        committed, failed, later, seconds = got
        assert (committed, failed, later) == (False, (victim,), [True] * 5), (rank, got)
        assert seconds < TIMEOUT_S / 2, (rank, seconds)


def _coordinator_tells_one(rank, size):
    """Rank 0 coordinates agree #1 and says False; it sends its decision to rank 1 only and
    dies. Ranks 2 and 3 never hear it from rank 0, and must still decide False (rank 1's
    decision), not the True their own flags would make."""
    import ddlcore
    from ddlcore.resilience import agree, channel

    comm = ddlcore.init()
    assert comm.agree(True)
    if rank == 0:
        send = channel.AgreeChannel._send

        def send_to_one(self, instance, out):
            decides = [(dst, msg) for dst, msg in out if msg.kind == agree.DECIDE]
            if instance == 1 and decides:
                send(self, instance, decides[:1])
                threading.Timer(0.3, os._exit, (0,)).start()
                return
            send(self, instance, out)

        channel.AgreeChannel._send = send_to_one
        comm.agree(False)
        time.sleep(30)  # the timer ends this process
    value = comm.agree(True)
    decided_by = comm.failed_ranks  # rank 0's decision: nobody had failed then
    return value, decided_by, comm.agree(True), comm.failed_ranks


def test_a_coordinator_that_dies_after_telling_one_rank_binds_the_rest():
    results = run_ranks(_coordinator_tells_one, 4, env=_ENV, timeout=120, may_die={0})
    assert results[1:] == [(False, (), True, (0,))] * 3, results


def _agree_while_one_dies(rank, size, victim, seed):
    """Every rank runs agree after agree; the victim SIGKILLs itself at a random moment (and
    waits for it after its last call). Then the survivors agree ten more times, without it."""
    import ddlcore

    comm = ddlcore.init()
    comm.agree(True)
    if rank == victim:
        delay = random.Random(seed).uniform(0.0, 0.3)
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
    values = [comm.agree(_flags(rank, i)) for i in range(150)]
    if rank == victim:
        time.sleep(30)
    tail = [comm.agree(_flags(rank, 1000 + i)) for i in range(10)]
    return values, tail, comm.failed_ranks


@pytest.mark.parametrize("victim", [0, 1, 3])
def test_a_kill_at_a_random_moment_leaves_the_survivors_in_step(victim):
    survivors = [r for r in range(4) if r != victim]
    # One random moment per victim (its rank seeds it): the suite's time is bounded.
    results = run_ranks(
        _agree_while_one_dies, 4, victim, victim, env=_ENV, timeout=120, may_die={victim}
    )
    assert len({(tuple(results[r][0]), tuple(results[r][1])) for r in survivors}) == 1, (
        victim,
        results,
    )
    values, tail, _ = results[survivors[0]]
    for rank in survivors:
        assert results[rank][2] == (victim,), (rank, results[rank][2])
    for i, value in enumerate(values):
        if value:  # the AND: no survivor said False
            assert all(_flags(r, i) for r in survivors), i
    assert tail == [all(_flags(r, 1000 + i) for r in survivors) for i in range(10)]


def _one_never_calls(rank, size):
    import ddlcore

    comm = ddlcore.init()
    comm.agree(True)
    if rank == 2:
        time.sleep(4.0)
        return None
    t0 = time.monotonic()
    try:
        comm.agree(True)
    except ddlcore.DDLTimeoutError as exc:
        return str(exc), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_rank_that_never_calls_agree_is_a_named_timeout():
    results = run_ranks(_one_never_calls, 3, env={"DDL_TIMEOUT": "2"}, timeout=60)
    for rank in (0, 1):
        message, seconds = results[rank]
        assert "agree #1" in message and "DDL_TIMEOUT=2 s" in message, message
        assert "rank(s) [2]" in message or "rank(s) [0]" in message, message
        assert seconds < 10, seconds
