"""`Communicator.shrink`: after a rank dies (rank 0, which served the store, included), the
survivors make a new communicator of themselves: dense ranks in the old order, epoch + 1,
member ids kept, and every collective on it right (against NumPy, random data, sizes 0, 1,
primes and not divisible by the ranks), on the boards, over shm schedules, tcp and ucx; twice
in a row; when another rank dies during the shrink; after a revoke with nobody dead; in a world
of one."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.collectives.test_agree import revoked_by
from tests.collectives.test_collectives import _transport_ready
from tests.harness import run_ranks

TIMEOUT_S = 20.0
SIZES = (0, 1, 7, 1009, 4099)


def _data(member: int, n: int, dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1000 * member + n)
    if dtype == "int32":
        return rng.integers(-1000, 1000, n).astype(np.int32)
    return rng.standard_normal(n).astype(dtype)


def _check(comm) -> list[str]:
    """Every size and dtype through allreduce, allgather and broadcast on ``comm``, compared
    with NumPy on the data of its members; what differed."""
    wrong = []
    for dtype in ("float32", "float64", "int32"):
        for n in SIZES:
            xs = [_data(m, n, dtype) for m in comm.member_ids]
            x = xs[comm.rank]
            got = comm.allreduce(x)
            want = np.sum(np.stack(xs), axis=0, dtype=x.dtype) if n else x
            if dtype == "int32":
                ok = np.array_equal(got, want)
            else:
                ok = np.allclose(got, want, rtol=1e-5, atol=1e-5)
            if not ok:
                wrong.append(f"allreduce {dtype} {n}")
            if not np.array_equal(comm.allgather(x), np.concatenate(xs)):
                wrong.append(f"allgather {dtype} {n}")
            y = x.copy()
            comm.broadcast(y, root=comm.size - 1)
            if not np.array_equal(y, xs[-1]):
                wrong.append(f"broadcast {dtype} {n}")
    return wrong


def _death_then_shrink(rank, size, victims):
    """The victims die one after another, each between two allreduces; the survivors shrink
    after each death and check the new communicator."""
    import ddlcore

    comm = ddlcore.init()
    x = np.ones(1000, np.float32)
    comm.allreduce(x)
    story = []
    for victim in victims:
        if comm.member_id == victim:
            os._exit(0)
        try:
            comm.allreduce(x)
        except ddlcore.PeerFailureError:
            pass
        t0 = time.monotonic()
        comm = comm.shrink()
        seconds = time.monotonic() - t0
        story.append((comm.rank, comm.size, comm.epoch, comm.member_ids, _check(comm), seconds))
    comm.close()
    return story


WORLDS = [
    ("auto", {}),  # one host: the boards
    ("shm", {"DDL_ALGO": "ring"}),  # schedules over the shm transport
    ("tcp", {}),
    ("ucx", {}),
]


@pytest.mark.parametrize("transport,extra", WORLDS, ids=lambda w: str(w))
def test_survivors_shrink_twice_and_compute_right(transport, extra):
    """Rank 0 (the store's) dies, then rank 2: two shrinks, 4 -> 3 -> 2 ranks."""
    if transport != "auto":
        _transport_ready(transport)
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_TRANSPORT": transport, **extra}
    results = run_ranks(_death_then_shrink, 4, (0, 2), env=env, timeout=180, may_die={0, 2})
    assert results[1][0][:4] == (0, 3, 1, (1, 2, 3)), results[1]
    assert results[3][0][:4] == (2, 3, 1, (1, 2, 3)), results[3]
    assert results[1][1][:4] == (0, 2, 2, (1, 3)), results[1]
    assert results[3][1][:4] == (1, 2, 2, (1, 3)), results[3]
    for rank in (1, 3):
        for _, _, _, _, wrong, seconds in results[rank]:
            assert wrong == [], (rank, wrong)
            assert seconds < TIMEOUT_S / 2, (rank, seconds)


def _dies_during_shrink(rank, size):
    """Rank 3 dies; while the survivors shrink, rank 1 dies too, just as the build of the
    new communicator starts (after the survivors agreed it is alive)."""
    import ddlcore
    from ddlcore import membership

    comm = ddlcore.init()
    x = np.ones(100, np.float32)
    comm.allreduce(x)
    if rank == 3:
        os._exit(0)
    if rank == 1:

        def die_in_build(*args, **kwargs):
            os._exit(0)

        membership._build = die_in_build
    try:
        comm.allreduce(x)
    except ddlcore.PeerFailureError:
        pass
    new = comm.shrink()
    return new.rank, new.size, new.member_ids, _check(new)


def test_a_rank_that_dies_during_the_shrink_is_left_out_too():
    env = {"DDL_TIMEOUT": str(TIMEOUT_S)}
    results = run_ranks(_dies_during_shrink, 4, env=env, timeout=120, may_die={1, 3})
    assert results[0] == (0, 2, (0, 2), []), results
    assert results[2] == (1, 2, (0, 2), []), results


def _revoke_then_shrink(rank, size):
    import ddlcore

    comm = ddlcore.init()
    revoked_by(comm, 1)
    new = comm.shrink()
    return new.size, new.epoch, new.member_ids, _check(new), comm.closed or "closing"


def test_a_shrink_with_nobody_dead_keeps_every_rank(pools):
    results = pools.run(_revoke_then_shrink, 3, env={"DDL_TIMEOUT": str(TIMEOUT_S)}, timeout=120)
    for got in results:
        assert got[:4] == (3, 1, (0, 1, 2), []), got


def test_a_world_of_one_shrinks_to_itself():
    import ddlcore

    comm = ddlcore.init(rank=0, size=1)
    new = comm.shrink()
    assert (new.rank, new.size, new.epoch, new.member_id) == (0, 1, 1, 0)
    assert comm.closed
    x = np.arange(5.0)
    assert np.array_equal(new.allreduce(x), x)
    new.close()


def _one_build_fails(rank, size):
    """Nobody dies, but rank 2's first build fails on its own (as a store it could not reach
    in time would make it): every rank gives up that attempt at once and they try again
    together, rather than leave some ranks with a communicator and some without."""
    import ddlcore
    from ddlcore import membership
    from ddlcore.errors import DDLError

    comm = ddlcore.init()
    revoked_by(comm, 0)
    if rank == 2:
        build = membership._build

        def fail_once(*args, **kwargs):
            membership._build = build
            raise DDLError("rank 2: a build that failed here only")

        membership._build = fail_once
    t0 = time.monotonic()
    new = comm.shrink()
    return new.size, new.epoch, _check(new), time.monotonic() - t0


def test_a_build_that_fails_on_one_rank_is_tried_again_by_all(pools):
    results = pools.run(_one_build_fails, 3, env={"DDL_TIMEOUT": str(TIMEOUT_S)}, timeout=120)
    for size, epoch, wrong, seconds in results:
        assert (size, epoch, wrong) == (3, 1, []), results
        assert seconds < TIMEOUT_S / 2, results
