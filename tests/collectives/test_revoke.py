"""`Communicator.revoke`: one rank revokes, and every pending and later call of the communicator
fails with `CommunicatorRevokedError` naming that rank, on every rank, within a few message
latencies (never by waiting out the deadline): the peers waiting for the revoking rank in a
collective, a collective of its own still in flight on its worker thread, a receive posted on a
peer, and the first call of a communicator that had run nothing yet. On every path and
transport: the boards, schedules over shm, tcp, ucx and MPI."""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.collectives.test_collectives import _transport_ready
from tests.harness import run_ranks

TIMEOUT_S = 20.0
REVOKER = 1
_SETTLE_S = 0.3  # how long the revoking rank lets the others block before it revokes


def _outcome(fn) -> tuple[str, str, float, int | None]:
    """(error class, message, seconds, the rank it blames) of ``fn()``."""
    import ddlcore

    t0 = time.monotonic()
    try:
        fn()
    except ddlcore.DDLError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - t0, getattr(exc, "peer", None)
    return "no error", "", time.monotonic() - t0, None


def _revoke_cases(rank, size):
    """Each case on a new communicator: {case: (error class, message, seconds, blamed rank)} of
    this rank's call that the revoke must fail, and of a call after it."""
    import ddlcore

    x = np.random.default_rng(rank).standard_normal(1009).astype(np.float32)
    out = {}

    # The others wait in an allreduce for the revoking rank, which never joins it.
    comm = ddlcore.init()
    comm.allreduce(x)  # every pair connected, in step
    if rank == REVOKER:
        time.sleep(_SETTLE_S)
        comm.revoke()
        comm.revoke()  # a second time: nothing more
        out["waiting"] = ("revoked", "", 0.0, REVOKER)
    else:
        out["waiting"] = _outcome(lambda: comm.allreduce(x))
    out["waiting, later call"] = _outcome(lambda: comm.allreduce(x))
    comm.close()

    # The revoking rank's own collective is in flight on its worker thread (the others never
    # join it); the others wait in a receive from it.
    comm = ddlcore.init()
    comm.allreduce(x)
    if rank == REVOKER:
        handle = comm.allreduce_async(x)
        time.sleep(_SETTLE_S)
        t0 = time.monotonic()
        comm.revoke()
        got = _outcome(handle.wait)
        out["in flight"] = (got[0], got[1], time.monotonic() - t0, got[3])
    else:
        out["in flight"] = _outcome(lambda: comm.recv(np.empty(4, np.float32), REVOKER, tag=3))
    comm.close()

    # Revoked before anything ran: the others' first collective fails.
    comm = ddlcore.init()
    if rank == REVOKER:
        comm.revoke()
        out["first call"] = _outcome(lambda: comm.allreduce(x))
    else:
        time.sleep(_SETTLE_S)
        out["first call"] = _outcome(lambda: comm.allreduce(x))
    comm.close()
    return out


WORLDS = [
    ("auto", {}),  # one host: the boards (and the compiled front end)
    ("shm", {"DDL_ALGO": "ring"}),  # schedules over the shm transport
    ("tcp", {}),
    ("tcp", {"DDL_ALGO": "mdring", "DDL_TOPOLOGY": "2x2"}),
    ("ucx", {}),
]


@pytest.mark.parametrize("transport,extra", WORLDS, ids=lambda w: str(w))
def test_revoke_fails_every_pending_and_later_call_on_every_rank(transport, extra, pools):
    if transport != "auto":
        _transport_ready(transport)
    nprocs = 4 if "DDL_TOPOLOGY" in extra else 3
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_TRANSPORT": transport, **extra}
    results = pools.run(_revoke_cases, nprocs, env=env, timeout=180)
    _check(results)


def test_revoke_under_mpiexec_over_the_mpi_transport():
    _transport_ready("mpi")
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_TRANSPORT": "mpi"}
    _check(run_ranks(_revoke_cases, 3, env=env, timeout=180, launcher="mpiexec"))


def _check(results) -> None:
    for rank, got in enumerate(results):
        for case, (cls, message, elapsed, peer) in got.items():
            where = f"rank {rank}, {case}: {cls}: {message}"
            if rank == REVOKER and case == "waiting":
                continue
            assert cls == "CommunicatorRevokedError", where
            assert peer == REVOKER, f"{where}: blames rank {peer}"
            assert f"rank {REVOKER}" in message and "revoke" in message, where
            assert elapsed < TIMEOUT_S / 2, f"{where} ({elapsed:.1f} s)"


def test_revoked_error_is_a_peer_failure_and_a_closed_communicator():
    """Handlers written for the failure that prompts a revoke, or for a broken communicator's
    refusal, catch it."""
    import ddlcore

    assert issubclass(ddlcore.CommunicatorRevokedError, ddlcore.PeerFailureError)
    assert issubclass(ddlcore.CommunicatorRevokedError, ddlcore.CommunicatorClosedError)
    err = ddlcore.CommunicatorRevokedError("rank 2 revoked it", 2)
    assert err.peer == 2


def test_revoke_code_round_trips_through_an_abort():
    """What a peer is told (`abort_code`) turns back into the same class (`abort_error`), also
    when passed on (`relay_of`)."""
    from ddlcore.transports.base import ABORT_REVOKED
    from ddlcore.transports.common import abort_code, abort_error, relay_of

    from ddlcore.errors import CommunicatorRevokedError

    err = CommunicatorRevokedError("rank 1 revoked the communicator", 1)
    assert abort_code(err) == ABORT_REVOKED
    told = abort_error(ABORT_REVOKED, 1, "it revoked the communicator")
    assert type(told) is CommunicatorRevokedError and told.peer == 1
    code, reason = relay_of(told)
    passed_on = abort_error(code, 2, reason)
    assert type(passed_on) is CommunicatorRevokedError and passed_on.peer == 1, passed_on
    assert "rank 1" in str(passed_on), passed_on
