"""No hang, ever: a dead rank, ranks that disagree, or a silent rank become a named DDLError on
every surviving rank, within the timeout (seconds here). Ranks that only disagree share their
processes (`pools`); the others are killed, stopped or left silent, so they get their own."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from tests.harness import event, run_ranks

TIMEOUT_S = 20.0


def _killed_mid_collective(rank, size, victim):
    import ddlcore

    comm = ddlcore.init()
    comm.allreduce(np.ones(1000, np.float32))  # everyone connected and in step
    x = np.ones(32_000_000, np.float32)  # 128 MB: long enough to die in the middle of it
    if rank == victim:
        comm.allreduce_async(x)
        time.sleep(0.01)  # let the transfer start, then die without closing anything
        os._exit(17)
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except ddlcore.DDLError as exc:
        elapsed = time.monotonic() - t0
        return type(exc).__name__, str(exc), elapsed
    raise AssertionError(f"rank {rank}: allreduce succeeded although rank {victim} died")


# mdring pipelined across a 2x2 box: the engine runs each stream on a thread of its own.
PIPELINED = {
    "DDL_ALGO": "mdring",
    "DDL_TOPOLOGY": "2x2",
    "DDL_SEGMENTS": "4",
    "DDL_TRANSPORT": "tcp",
}


@pytest.mark.parametrize(
    "nprocs,victim,extra",
    [(2, 1, {}), (3, 1, {}), (4, 2, {}), (4, 2, PIPELINED), (4, 1, PIPELINED)],
)
def test_killed_rank_fails_every_survivor_fast(nprocs, victim, extra):
    results = run_ranks(
        _killed_mid_collective,
        nprocs,
        victim,
        may_die={victim},
        env={"DDL_TIMEOUT": str(TIMEOUT_S), **extra},
        timeout=90,
    )
    for rank, res in enumerate(results):
        if rank == victim:
            continue
        name, message, elapsed = res
        assert elapsed < TIMEOUT_S / 2, f"rank {rank} took {elapsed:.1f} s: {message}"
        assert f"rank {rank}" in message and "allreduce #" in message, message
        assert name in ("PeerFailureError", "DDLTimeoutError", "CollectiveMismatchError"), name


def _mismatched(rank, size, kind):
    import ddlcore

    comm = ddlcore.init()
    if kind == "count":
        x = np.ones(1000 + 17 * rank, np.float32)
        call = lambda: comm.allreduce(x)  # noqa: E731
    elif kind == "dtype":
        x = np.ones(1000, np.float32 if rank else np.int32)
        call = lambda: comm.allreduce(x)  # noqa: E731
    elif kind == "op":
        call = lambda: comm.allreduce(np.ones(1000, np.float32), op="max" if rank else "sum")  # noqa: E731
    else:  # different collectives
        call = (
            (lambda: comm.allgather(np.ones(1000, np.float32)))
            if rank
            else (lambda: comm.allreduce(np.ones(1000 * size, np.float32)))
        )
    t0 = time.monotonic()
    try:
        call()
    except ddlcore.DDLError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0
    finally:
        comm.close()
    raise AssertionError(f"rank {rank}: no error for mismatched {kind}")


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "collective"])
@pytest.mark.parametrize("nprocs", [2, 3])
def test_mismatch_raises_on_every_rank(kind, nprocs, pools):
    results = pools.run(_mismatched, nprocs, kind, env={"DDL_TIMEOUT": str(TIMEOUT_S)}, timeout=90)
    for rank, (name, message, elapsed) in enumerate(results):
        assert elapsed < TIMEOUT_S / 2, f"rank {rank} waited {elapsed:.1f} s: {message}"
        assert name in ("CollectiveMismatchError", "PeerFailureError"), (name, message)


def _debug_check(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        comm.allreduce(np.ones(10, np.float32))  # agreeing calls pass the check
        try:
            comm.allreduce(np.ones(10 + rank, np.float32))
        except ddlcore.CollectiveMismatchError as exc:
            return str(exc)
    raise AssertionError("DDL_DEBUG did not catch the mismatch")


def test_debug_check_names_every_rank(pools):
    msgs = pools.run(_debug_check, 3, env={"DDL_DEBUG": "1", "DDL_TIMEOUT": "20"}, timeout=60)
    for msg in msgs:
        assert "rank 0: allreduce(10 x float32, sum)" in msg, msg
        assert "rank 2: allreduce(12 x float32, sum)" in msg, msg


def _silent_peer(rank, size, done):
    import ddlcore

    comm = ddlcore.init(timeout=2.0)
    comm.barrier()
    if rank == 1:
        assert done.wait(50), "rank 0 never finished"  # never joins the collective
        return None
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(100, np.float32))
    except ddlcore.DDLTimeoutError as exc:
        return str(exc), time.monotonic() - t0
    finally:
        done.set()
    raise AssertionError("no timeout")


def test_silent_peer_times_out_with_context():
    res = run_ranks(_silent_peer, 2, event(), timeout=60)
    message, elapsed = res[0]
    assert 1.5 < elapsed < 2 + 8, elapsed  # the 2 s deadline: not early (a loaded box is late)
    assert "rank 0" in message and "allreduce #1" in message and "rank 1" in message, message


def _after_failure(rank, size, done):
    import ddlcore

    comm = ddlcore.init(timeout=2.0)
    if rank == 1:
        assert done.wait(50), "rank 0 never finished"  # silent until rank 0 has seen it all
        return None
    try:
        with pytest.raises(ddlcore.DDLTimeoutError):
            comm.allreduce(np.ones(10, np.float32))
        with pytest.raises(ddlcore.CommunicatorClosedError, match="failed earlier"):
            comm.allreduce(np.ones(10, np.float32))
    finally:
        done.set()
    return True


def test_broken_communicator_refuses_further_collectives():
    run_ranks(_after_failure, 2, event(), timeout=60)


def _relayed(rank, size, victim):
    import ddlcore

    comm = ddlcore.init()
    comm.allreduce(np.random.default_rng(rank).standard_normal(1009))
    comm.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.allreduce(np.random.default_rng(rank).standard_normal(1009))
    except ddlcore.PeerFailureError as exc:
        return exc.peer, str(exc)
    raise AssertionError(f"rank {rank}: allreduce succeeded although rank {victim} died")


@pytest.mark.parametrize("algo", ["auto", "ring"])
def test_relayed_failure_names_its_origin_once(algo):
    # Some survivors see rank 1 die, the others hear it from them: all must blame rank 1, and say
    # the collective and the cause once each.
    results = run_ranks(
        _relayed,
        4,
        1,
        may_die={1},
        timeout=90,
        env={"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_ALGO": algo},
    )
    for rank, res in enumerate(results):
        if rank == 1:
            continue
        peer, message = res
        assert peer == 1, f"rank {rank} blames rank {peer}: {message}"
        assert message.startswith(f"rank {rank}: allreduce #"), message
        assert message.count("allreduce #") == 1 and message.count("exited") == 1, message


def _stopped_mid_call(rank, size, timeout):
    import threading

    import ddlcore

    comm = ddlcore.init(timeout=timeout)
    pids = comm.allgather(np.array([os.getpid()], np.int64))
    x = np.random.default_rng(rank).standard_normal(8_000_000).astype(np.float32)  # 32 MB
    comm.allreduce(x[:1000])
    if rank == 1:  # stop, most likely in the middle of reading and writing the peer's buffers
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGSTOP)).start()
    try:
        for _ in range(100_000):  # until rank 1 stops
            t0 = time.monotonic()
            comm.allreduce(x)
    except ddlcore.DDLError as exc:
        elapsed = time.monotonic() - t0
        if rank == 0:
            os.kill(int(pids[1]), signal.SIGCONT)
        return type(exc).__name__, elapsed
    raise AssertionError(f"rank {rank}: 100,000 allreduces and rank 1 never stopped")


def test_timeout_with_a_stopped_peer_fires_within_timeout_plus_one_second():
    """With the heartbeat off, the deadline alone ends the wait."""
    timeout = 3.0
    res = run_ranks(_stopped_mid_call, 2, timeout, timeout=90, env={"DDL_HEARTBEAT_TIMEOUT": "0"})
    name, elapsed = res[0]
    assert name == "DDLTimeoutError", res
    assert elapsed < timeout + 1, f"rank 0 raised after {elapsed:.1f} s with DDL_TIMEOUT={timeout}"


def test_a_peer_stopped_mid_call_is_excluded_before_the_timeout():
    """By default the heartbeat's silence ends it first, as a failure of that peer."""
    timeout = 30.0
    res = run_ranks(_stopped_mid_call, 2, timeout, timeout=90)
    name, elapsed = res[0]
    assert name == "PeerFailureError", res
    assert elapsed < timeout / 2, f"rank 0 raised after {elapsed:.1f} s"


def _killed_with_a_forked_child(rank, size):
    """Rank 1 forks a child that lives on (a data loader's worker), then is killed. Over tcp
    (no pidfd watches it) its death is seen only when its connections end: the child must not
    hold them open."""
    import ddlcore

    comm = ddlcore.init()
    x = np.ones(1000, np.float32)
    comm.allreduce(x)  # every connection open
    if rank == 1:
        if os.fork() == 0:
            time.sleep(TIMEOUT_S / 2)  # longer than the survivors may wait
            os._exit(0)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except ddlcore.DDLError as exc:
        return type(exc).__name__, time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_forked_child_does_not_hide_its_parents_death():
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_TRANSPORT": "tcp"}
    results = run_ranks(_killed_with_a_forked_child, 2, env=env, timeout=90, may_die={1})
    name, elapsed = results[0]
    assert name == "PeerFailureError" and elapsed < TIMEOUT_S / 4, results[0]
