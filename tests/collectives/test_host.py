"""The host collectives (``ddlcore.execution.hostcoll``): every rank on one host over shm runs each
collective through shared boards, small inputs through the slots and large ones by reading the
peers' buffers. The collective matrix (test_collectives.py, transport shm) covers dtype x op x
count on both paths; this file covers what is particular to them: sizes at the slot and chunk
boundaries, in place, async interleaving, failures, and the choice itself."""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest

from tests.collectives import matrix
from tests.harness import event, patch, run_ranks

SMALL_MAX = 1 << 18  # hostcoll.slots_max of 2-4 ranks: the slots up to it, direct reads above
CHUNK = 1 << 18
TIMEOUT_S = 20.0


def _boundaries(rank, size, thin=False):
    """In- and out-of-place allreduce, and the other collectives, at counts around the slot
    size and the direct-read chunk, for every op on float32, int64 and float16 (``thin``:
    every op on float32, sum on the others)."""
    from ddlcore.kernels import reference

    import ddlcore

    digests = {}
    with ddlcore.init() as comm:
        assert comm.describe("allreduce", SMALL_MAX).algorithm == "direct"
        assert comm._host is not None and comm._host.direct
        for dtype in (np.float32, np.int64, np.float16):
            isz = np.dtype(dtype).itemsize
            counts = sorted(
                {
                    SMALL_MAX // isz - 1,
                    SMALL_MAX // isz,
                    SMALL_MAX // isz + 1,
                    size * CHUNK // isz + 3,
                    3 * size * CHUNK // isz - 1,
                    1_000_003,
                }
            )
            for count in counts:
                for op in matrix.OPS if dtype is np.float32 or not thin else ["sum"]:
                    case = f"{np.dtype(dtype).name} {op} count={count}"
                    digests[case] = matrix.allreduce_both_ways(comm, dtype, count, op)
                k = count // size
                xs = [matrix.random_input(dtype, k * size, r, count, "sum") for r in range(size)]
                got = comm.reduce_scatter(xs[rank])
                want = reference.reduce_ref(xs, "sum")[rank * k : (rank + 1) * k]
                matrix.check_close(got, want, dtype, "sum", size, f"reduce_scatter {count}")
                got = comm.allgather(xs[rank][:k])
                np.testing.assert_array_equal(got, np.concatenate([x[:k] for x in xs]))
                b = xs[rank].copy()
                comm.broadcast(b, root=size - 1)
                np.testing.assert_array_equal(b, xs[size - 1])
    return digests


# Every op on every dtype in the smallest world (the sizes, not the ops, are the subject); the
# thin slice in the others, whose boundaries (and inputs) are larger.
@pytest.mark.parametrize(
    "nprocs,thin", [pytest.param(2, False, marks=pytest.mark.slow), (3, True), (4, True)]
)
def test_sizes_around_slot_and_chunk(nprocs, thin, pools):
    results = pools.run(_boundaries, nprocs, thin, env={"DDL_TRANSPORT": "shm"}, timeout=240)
    for rank in range(1, nprocs):
        assert results[rank] == results[0], f"rank {rank} differs from rank 0"


def _same_as_schedules(rank, size):
    """Exact ops (integers, min/max) give the same bits through the boards and the ring."""
    import ddlcore

    out = {}
    for algo in ("auto", "ring"):
        with ddlcore.init(algo=algo) as comm:
            assert (comm._host is not None) == (algo == "auto")
            for count in (5, 4099, 700_001):
                for dtype, op in ((np.int32, "sum"), (np.float32, "max"), (np.int64, "prod")):
                    x = matrix.random_input(dtype, count, rank, 7, op)
                    out[(algo, count, np.dtype(dtype).name, op)] = matrix.digest(
                        comm.allreduce(x, op=op)
                    )
    return out


def test_results_match_the_ring_schedule_bit_for_bit(pools):
    for res in pools.run(_same_as_schedules, 3, env={"DDL_TRANSPORT": "shm"}, timeout=120):
        for (algo, *case), digest in res.items():
            if algo == "auto":
                assert digest == res[("ring", *case)], case


def _async_interleaved(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        xs = [np.full(n, rank + 1, np.float32) for n in (10, 300_000, 7, 2_000_000)]
        handles = [comm.allreduce_async(x) for x in xs]
        mid = comm.allreduce(np.full(3, rank, np.int64))  # queues behind the async ones
        for h, x in zip(handles, xs, strict=True):
            np.testing.assert_array_equal(h.wait(), np.full(x.size, size * (size + 1) / 2))
        np.testing.assert_array_equal(mid, np.full(3, size * (size - 1) // 2))
        comm.barrier()
    return True


def test_async_and_sync_calls_keep_their_order(pools):
    assert all(pools.run(_async_interleaved, 3, timeout=60))


def _mismatch(rank, size, nbytes):
    import ddlcore

    comm = ddlcore.init()
    n = nbytes // 4
    t0 = time.monotonic()
    try:
        if rank == 0:
            comm.allreduce(np.ones(n, np.float32))
        else:
            comm.allgather(np.ones(n, np.float32))
    except ddlcore.CollectiveMismatchError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("different collectives were not detected")


@pytest.mark.parametrize("nbytes", [4096, 4 << 20])
def test_different_collectives_fail_at_once_naming_both(nbytes):
    results = run_ranks(_mismatch, 2, nbytes, env={"DDL_TIMEOUT": str(TIMEOUT_S)}, timeout=60)
    for rank, (message, elapsed) in enumerate(results):
        assert elapsed < TIMEOUT_S / 2, (elapsed, message)
        assert f"rank {rank}: " in message and "via direct" in message, message
        assert "allreduce(" in message and "allgather(" in message, message


def _dies(rank, size, victim, nbytes):
    import ddlcore

    comm = ddlcore.init()
    comm.barrier()
    if rank == victim:
        time.sleep(0.2)
        os._exit(3)
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(nbytes // 4, np.float32))
    except ddlcore.PeerFailureError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("the dead rank was not noticed")


@pytest.mark.parametrize("nbytes", [4096, 4 << 20])
def test_dead_rank_is_named_within_milliseconds(nbytes):
    results = run_ranks(
        _dies, 3, 1, nbytes, may_die={1}, env={"DDL_TIMEOUT": str(TIMEOUT_S)}, timeout=60
    )
    for rank in (0, 2):
        message, elapsed = results[rank]
        assert elapsed < TIMEOUT_S / 2, (elapsed, message)
        assert f"rank {rank}: allreduce #1" in message and "rank 1" in message, message


def _silent(rank, size, done):
    import ddlcore

    comm = ddlcore.init(timeout=1.0)
    comm.barrier()
    if rank == 1:
        assert done.wait(50), "rank 0 never finished"  # silent until rank 0 timed out
        return "waited"
    try:
        comm.allreduce(np.ones(10, np.float32))
    except ddlcore.DDLTimeoutError as exc:
        return str(exc)
    finally:
        done.set()
    raise AssertionError("no timeout")


def test_silent_rank_times_out_with_its_name():
    results = run_ranks(_silent, 2, event(), timeout=60)
    assert "rank 1 did not reach sync point" in results[0] and "DDL_TIMEOUT=1" in results[0], (
        results[0]
    )


def _sizes_across_paths(rank, size):
    """Direct reads off (Yama): 4 KB runs on the boards, 1 MB on the schedules. Ranks that
    disagree across that line still meet at a sync point on the boards and fail at once."""
    from ddlcore.transports.shm import boards

    import ddlcore

    patch(boards, "cma_allowed", lambda: False)
    comm = ddlcore.init(timeout=TIMEOUT_S)
    comm.barrier()
    t0 = time.monotonic()
    try:
        comm.allreduce(np.ones(1000 if rank == 0 else 1 << 18, np.float32))
    except ddlcore.CollectiveMismatchError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("mismatched sizes not detected")


def test_a_size_mismatch_across_the_paths_fails_at_once():
    for message, elapsed in run_ranks(_sizes_across_paths, 2, timeout=60):
        assert elapsed < TIMEOUT_S / 2, (elapsed, message)
        assert "allreduce(1000 x float32" in message, message
        assert "allreduce(262144 x float32" in message, message


def _reduce_scatter_into_own_block(rank, size):
    """out = this rank's block of x: the direct path must read our block before writing it."""
    from ddlcore.kernels import reference

    import ddlcore

    with ddlcore.init() as comm:
        for k in (5, 300_001):
            xs = [matrix.random_input(np.float32, k * size, r, k, "sum") for r in range(size)]
            x = xs[rank].copy()
            block = x[rank * k : (rank + 1) * k]
            comm.reduce_scatter(x, out=block)
            want = reference.reduce_ref(xs, "sum")[rank * k : (rank + 1) * k]
            matrix.check_close(block, want, np.float32, "sum", size, f"rank {rank} k={k}")
    return True


def test_reduce_scatter_into_its_own_block_of_the_input(pools):
    assert all(pools.run(_reduce_scatter_into_own_block, 4, timeout=60))


def _no_direct_reads(rank, size):
    from ddlcore.transports.shm import boards

    import ddlcore

    patch(boards, "cma_allowed", lambda: False)  # as under Yama ptrace_scope >= 1
    with ddlcore.init() as comm:
        assert not comm._host.direct
        assert comm.describe("allreduce", 4096).algorithm == "direct"
        assert comm.describe("allreduce", 1 << 20).algorithm != "direct"
        x = np.arange(1_000_003, dtype=np.float64) * (rank + 1)
        np.testing.assert_array_equal(comm.allreduce(x), np.arange(1_000_003) * 3.0)
        np.testing.assert_array_equal(comm.allreduce(x[:5]), np.arange(5) * 3.0)
    return True


def test_without_direct_reads_large_messages_take_the_schedules(pools):
    assert all(pools.run(_no_direct_reads, 2, timeout=60))


def _boards_of(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/ddl-{pid}-*-board-*")


def _closes(rank, size):
    import ddlcore

    comm = ddlcore.init()
    mine = _boards_of(os.getpid())
    assert len(mine) == 1, mine
    comm.allreduce(np.ones(4, np.float32))
    comm.close()
    return _boards_of(os.getpid())


def test_close_removes_the_board():
    assert run_ranks(_closes, 2, timeout=60) == [[], []]


def _forced(rank, size):
    import ddlcore

    try:
        ddlcore.init(algo="direct")
    except ValueError as exc:
        return str(exc)
    return "initialised"


def test_direct_forced_where_it_cannot_run_says_why(pools):
    for message in pools.run(_forced, 2, env={"DDL_TRANSPORT": "tcp"}, timeout=60):
        assert "DDL_ALGO=direct needs every rank on one host" in message, message
        assert "talk tcp" in message, message
