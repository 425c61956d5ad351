"""mdring with its host dimensions on the boards: when the box has host and network dimensions,
an allreduce is a reduce-scatter of parts among each host's ranks through shared memory
(``hostcoll``), the rings across hosts on each rank's part (schedules over TCP), and an allgather
of the parts through shared memory again. Hosts are told apart by DDL_HOST_ID, so the "hosts" of
these tests share this machine; the transports between them are TCP as between real hosts."""

from __future__ import annotations

import numpy as np
import pytest

from tests.collectives import matrix
from tests.collectives.test_host import _dies
from tests.harness import patch, run_ranks

SMALL_MAX = 1 << 18  # hostcoll.slots_max of 2-4 ranks a host: the slots up to it, then direct
TIMEOUT_S = 20.0


def _hosts(*names):
    return {r: {"DDL_HOST_ID": h} for r, h in enumerate(names)}


# A slow network, as between real hosts: the cost model picks mdring for every size here.
SLOW_NET = {"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6,1e-3"}


def _matrix(rank, size, thin=False):
    """Every op on float32, int32 and float64 at sizes 0, 1, primes, not divisible by the
    ranks or by the hosts, on both sides of the slots' size; in and out of place. ``thin``:
    every op on float32, sum on the others."""
    from ddlcore.kernels import reference

    import ddlcore

    digests = {}
    with ddlcore.init() as comm:
        choice = comm.describe("allreduce", 16 << 20)
        assert choice.algorithm == "mdring" and choice.host_path == "direct", choice
        assert comm._node is not None and comm._node.size == comm.local_size
        for dtype in (np.float32, np.int32, np.float64):
            isz = np.dtype(dtype).itemsize
            # Up to 64 KB the cost model picks recursive doubling; up to 256 KB mdring
            # through the slots, above that through direct reads.
            for count in (0, 1, 7, 1009, SMALL_MAX // isz, SMALL_MAX // isz + 1, 300_007):
                for op in matrix.OPS if dtype is np.float32 or not thin else ["sum"]:
                    case = f"{np.dtype(dtype).name} {op} count={count}"
                    digests[case] = matrix.allreduce_both_ways(comm, dtype, count, op)
        # Reduce-scatter and allgather between these allreduces (`_rs_ag_matrix` has more).
        k = 1001
        xs = [matrix.random_input(np.float32, k * size, r, k, "sum") for r in range(size)]
        got = comm.reduce_scatter(xs[rank])
        want = reference.reduce_ref(xs, "sum")[rank * k : (rank + 1) * k]
        matrix.check_close(got, want, np.float32, "sum", size, "reduce_scatter")
        np.testing.assert_array_equal(
            comm.allgather(xs[rank][:k]), np.concatenate([x[:k] for x in xs])
        )
    return digests


def _rs_ag_matrix(rank, size, thin=False):
    """Reduce-scatter (every op) and allgather of every dtype on the host-staged path, at
    per-rank counts 0, 1, primes and either side of the slots' size; results checked against
    NumPy, inputs untouched. Returns digests for the bit-identity check. ``thin``: float32 at
    every count and op, the other dtypes (sum) on either side of the slots' size."""
    from ddlcore.kernels import reference

    import ddlcore
    from ddlcore.execution.paths import host_staged

    taken = []
    spied = {
        name: lambda *a, _real=real, _name=name, **kw: (taken.append(_name), _real(*a, **kw))[1]
        for name, real in host_staged.RUN.items()
    }
    patch(host_staged, "RUN", spied)
    digests = {}
    with ddlcore.init() as comm:
        for collective in ("reduce_scatter", "allgather"):
            choice = comm.describe(
                collective, (size if collective == "reduce_scatter" else 1) * (4 << 20)
            )
            assert choice.algorithm == "mdring" and choice.host_path == "direct", choice
        for dtype in matrix.DTYPES:
            isz = np.dtype(dtype).itemsize
            above = SMALL_MAX // isz // size + 1
            for k in (0, 1, 7, 1009, above, 30011):
                if thin and dtype is not np.float32 and k not in (1009, above):
                    continue
                for op in matrix.OPS if dtype is np.float32 or not thin else ["sum"]:
                    case = f"reduce_scatter {np.dtype(dtype).name} {op} k={k}"
                    xs = [matrix.random_input(dtype, size * k, r, k, op) for r in range(size)]
                    x = xs[rank].copy()
                    got = comm.reduce_scatter(x, op=op)
                    want = reference.reduce_ref(xs, op)[rank * k : (rank + 1) * k]
                    matrix.check_close(got, want, dtype, op, size, f"rank {rank}: {case}")
                    np.testing.assert_array_equal(x, xs[rank])
                    digests[case] = matrix.digest(got)
                case = f"allgather {np.dtype(dtype).name} k={k}"
                xs = [matrix.random_input(dtype, k, r, k + 1, "sum") for r in range(size)]
                out = np.empty(size * k, dtype)
                assert comm.allgather(xs[rank], out=out) is out
                np.testing.assert_array_equal(
                    out.view(np.uint8), np.concatenate(xs).view(np.uint8), err_msg=case
                )
    assert "reduce_scatter" in taken and "allgather" in taken, taken
    return digests


# The full matrix in one placement (abba: every block through the staging buffer); the others
# (whose subject is the placement) run the thin slice.
@pytest.mark.parametrize(
    "hosts,thin",
    [pytest.param("abba", False, marks=pytest.mark.slow)]
    + [(hosts, True) for hosts in ("abab", "aaabbb", "aabbcc")],
)
def test_reduce_scatter_and_allgather_with_host_dimensions_on_the_boards(hosts, thin, pools):
    """Cyclic placement (abab: the blocks are already in host-staged order), host by host
    (aaabbb, aabbcc: a board call per host) and neither (abba: the blocks copied through a
    staging buffer); 2 and 3 hosts."""
    results = pools.run(
        _rs_ag_matrix,
        len(hosts),
        thin,
        rank_envs=_hosts(*hosts),
        env={**SLOW_NET, "DDL_ALGO": "mdring"},
        timeout=300,
    )
    for rank in range(1, len(hosts)):
        same = {c for c, d in results[rank].items() if c.startswith("allgather")}
        assert {c: results[rank][c] for c in same} == {c: results[0][c] for c in same}


@pytest.mark.parametrize(
    "hosts,thin",
    [pytest.param("abcabc", False, marks=pytest.mark.slow)]
    + [(hosts, True) for hosts in ("abab", "aaabbb", "aabbcc")],
)
def test_every_op_and_size_with_host_dimensions_on_the_boards(hosts, thin, pools):
    """2 x 2, 3 ranks x 2 hosts, 2 ranks x 3 hosts, placed cyclically (abab, abcabc: each
    host's boards hold ranks that are not neighbours in rank order) or host by host: results
    are right and the same bits on every rank. Every op on every dtype in one placement, the
    thin slice in the others."""
    results = pools.run(
        _matrix, len(hosts), thin, rank_envs=_hosts(*hosts), env=SLOW_NET, timeout=300
    )
    for rank in range(1, len(hosts)):
        assert results[rank] == results[0], f"rank {rank} differs from rank 0"


def _spy_on_pipeline():
    """Record the segment count of every pipelined call (so a test knows the path it took)."""
    from ddlcore.execution import pipeline

    runs = []
    real = pipeline.run

    def spy(nseg, *args, **kw):
        runs.append(nseg)
        return real(nseg, *args, **kw)

    patch(pipeline, "run", spy)
    return runs


def _segmented(rank, size, thin=False):
    """The pipelined path (segments of the allreduce cross the network while the boards reduce
    the next and spread the previous), with segments made tiny so that every size takes
    several, of unequal lengths, down to segments shorter than a host's rank count (zero-length
    parts) and segments on both sides of the boards' slots/direct switch. ``thin``: int32
    takes sum and avg (its own wider form) alone, and not the ~500 segments of 1009 elements
    (float32 takes those, each segment one call on the boards and one on the network)."""
    import ddlcore
    from ddlcore.execution.paths import host_staged

    # Tiny segments for the path itself; the cost model still prices the real ones.
    cap = [64]
    patch(host_staged, "host_segments", lambda nbytes: max(1, min(cap[0], nbytes // 8)))
    runs = _spy_on_pipeline()
    digests = {}
    with ddlcore.init() as comm:
        for dtype in (np.float32, np.int32):
            isz = np.dtype(dtype).itemsize
            # (smaller sizes take the network dimension first: no host phases to pipeline)
            for count in (1009, 4099, SMALL_MAX // isz * 3, 300_007):
                if thin and dtype is np.int32 and count == 1009:
                    continue
                # 1009: ~500 segments of 2 elements, fewer than aaabbb's 3 ranks per host;
                # sum, and avg (whose integer form doubles the bytes, so the segments) there:
                # three quarters of this test's time went to the other ops on that many
                # segments, the same path as sum's (every op is pipelined at the other counts)
                cap[0] = 600 if count == 1009 else 64
                thin_here = count == 1009 or (thin and dtype is np.int32)
                for op in ("sum", "avg") if thin_here else matrix.OPS:
                    case = f"{np.dtype(dtype).name} {op} count={count}"
                    # integer avg runs as a sum of int64 (ddlcore.execution.int_avg): twice the bytes
                    wide = 8 if op == "avg" and np.dtype(dtype).kind == "i" else isz
                    nseg = host_staged.host_segments(count * wide)
                    del runs[:]
                    digests[case] = matrix.allreduce_both_ways(comm, dtype, count, op)
                    assert runs == [nseg, nseg] and nseg > 1, (case, runs)
    return digests


def _racked_rs_ag(rank, size):
    from ddlcore.kernels import reference

    import ddlcore

    with ddlcore.init() as comm:
        assert comm.topology.shape == "2x2x2", comm.topology.shape
        assert comm.describe("reduce_scatter", size << 20).host_path == "direct"
        for k in (0, 7, 30011):
            for op in ("sum", "avg"):
                xs = [matrix.random_input(np.float32, size * k, r, k, op) for r in range(size)]
                want = reference.reduce_ref(xs, op)[rank * k : (rank + 1) * k]
                matrix.check_close(
                    comm.reduce_scatter(xs[rank], op=op),
                    want,
                    np.float32,
                    op,
                    size,
                    f"reduce_scatter {op} k={k}",
                )
            got = comm.allgather(xs[rank][:k])
            np.testing.assert_array_equal(got, np.concatenate([x[:k] for x in xs]))


def test_reduce_scatter_and_allgather_across_hosts_and_racks(pools):
    """2 ranks x 2 hosts x 2 racks: two network dimensions, whose positions (host in rack,
    then rack) do not follow rank order; each network position's board call still finds the
    blocks of its ranks."""
    envs = {r: {"DDL_HOST_ID": "abcd"[r // 2], "DDL_RACK_ID": "xy"[r // 4]} for r in range(8)}
    pools.run(
        _racked_rs_ag,
        8,
        rank_envs=envs,
        timeout=300,
        env={"DDL_LINK_BW": "5e9,1e8,5e7", "DDL_LINK_LAT": "1e-6,1e-3,2e-3", "DDL_ALGO": "mdring"},
    )


@pytest.mark.parametrize(
    "hosts,thin", [pytest.param("abab", False, marks=pytest.mark.slow), ("aaabbb", True)]
)
def test_segments_pipelined_across_the_network(hosts, thin, pools):
    results = pools.run(
        _segmented,
        len(hosts),
        thin,
        rank_envs=_hosts(*hosts),
        env={**SLOW_NET, "DDL_ALGO": "mdring"},
        timeout=300,
    )
    for rank in range(1, len(hosts)):
        assert results[rank] == results[0], f"rank {rank} differs from rank 0"


def _dies_mid_pipeline(rank, size, victim):
    import os
    import threading
    import time

    import ddlcore

    runs = _spy_on_pipeline()
    comm = ddlcore.init()
    comm.barrier()
    x = np.ones(16 << 20, np.float32)  # 64 MB: 8 segments
    if rank == victim:
        threading.Timer(0.15, os._exit, (3,)).start()
    t0 = time.monotonic()
    try:
        for _ in range(20):
            comm.allreduce(x)
    except ddlcore.DDLError as exc:
        assert runs and runs[0] == 8, runs
        left = [t.name for t in threading.enumerate() if t.name.endswith("-network")]
        assert not left, left  # the helper thread ended before the error was raised
        return str(exc), time.monotonic() - t0
    raise AssertionError("the dead rank was not noticed")


def test_a_rank_dying_mid_pipeline_fails_every_survivor_quickly():
    """Rank 1 exits while segments are on the boards and on the network at once: both threads
    of every survivor stop and the call fails, naming the call, long before DDL_TIMEOUT."""
    results = run_ranks(
        _dies_mid_pipeline,
        4,
        1,
        may_die={1},
        rank_envs=_hosts(*"abab"),
        env={**SLOW_NET, "DDL_TIMEOUT": str(TIMEOUT_S)},
        timeout=120,
    )
    for rank in (0, 2, 3):
        message, elapsed = results[rank]
        assert elapsed < TIMEOUT_S / 2, (rank, elapsed, message)
        assert f"rank {rank}: allreduce #" in message, message


def _direct_reads_on_one_host_only(rank, size):
    import os

    from ddlcore.transports.shm import boards

    import ddlcore

    if os.environ["DDL_HOST_ID"] == "b":  # as under Yama ptrace_scope >= 1 on host b alone
        patch(boards, "cma_allowed", lambda: False)
    with ddlcore.init() as comm:
        assert comm._node is not None and not comm._node.direct  # agreed across the hosts
        k = 1 << 20  # 4 MB a rank: past the slots, so direct reads would decide the path
        xs = [np.arange(k * size, dtype=np.float32) % 97 * (r + 1) for r in range(size)]
        total = sum(xs)
        np.testing.assert_array_equal(comm.allreduce(xs[rank]), total)
        np.testing.assert_array_equal(
            comm.reduce_scatter(xs[rank]), total[rank * k : (rank + 1) * k]
        )
        np.testing.assert_array_equal(
            comm.allgather(xs[rank][:k]), np.concatenate([x[:k] for x in xs])
        )


def test_direct_reads_are_agreed_across_hosts(pools):
    """Host b cannot read its ranks' memory directly, host a can: every host then leaves
    large calls to the schedules (host a alone on the host-staged path, whose allreduce
    segments are not the schedule's messages, used to wait out DDL_TIMEOUT)."""
    pools.run(
        _direct_reads_on_one_host_only,
        4,
        rank_envs=_hosts(*"aabb"),
        timeout=120,
        env={**SLOW_NET, "DDL_ALGO": "mdring", "DDL_TIMEOUT": str(TIMEOUT_S)},
    )


def _choices(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        x = np.full(50_000, rank + 1.0, np.float32)
        np.testing.assert_array_equal(comm.allreduce(x), np.full(50_000, size * (size + 1) / 2))
        gather = comm.describe("allgather", 1 << 20)
        # the cost model reads an allgather's output: 1 MB in from each rank is size MB out
        from ddlcore import config
        from ddlcore.planning import tuning

        model = tuning.choose(
            "allgather",
            comm.topology,
            size << 20,
            config.get("DDL_ALGO"),
            1 << 20,
            host_path=comm._node is not None,
        )
        assert (gather.algorithm, gather.predicted_s) == (model.algorithm, model.predicted_s)
        return (
            comm._node is not None,
            comm.describe("allreduce", 1 << 20).describe(),
            (gather.algorithm, gather.host_path),
        )


def test_forced_ring_leaves_the_boards_out(pools):
    for has_node, text, _ in pools.run(
        _choices, 4, rank_envs=_hosts(*"abab"), env={**SLOW_NET, "DDL_ALGO": "ring"}, timeout=90
    ):
        assert not has_node and text.startswith("ring"), text


def test_the_choice_names_the_host_path(pools):
    for has_node, text, other in pools.run(
        _choices, 4, rank_envs=_hosts(*"abab"), env=SLOW_NET, timeout=90
    ):
        assert has_node and "host dimensions through shared memory (direct)" in text, text
        # reduce_scatter and allgather take it too, where the cost model picks mdring
        assert other[1] == ("direct" if other[0] == "mdring" else ""), other


def _without_direct_reads(rank, size):
    from ddlcore.transports.shm import boards

    import ddlcore

    patch(boards, "cma_allowed", lambda: False)  # as under Yama ptrace_scope >= 1
    with ddlcore.init() as comm:
        assert comm.describe("allreduce", SMALL_MAX).host_path == "direct"  # the slots
        assert comm.describe("allreduce", 1 << 20).host_path == ""  # the schedule
        for n in (SMALL_MAX // 8, 300_007):
            x = np.arange(n, dtype=np.float64) * (rank + 1)
            np.testing.assert_array_equal(comm.allreduce(x), np.arange(n) * 10.0)
    return True


def test_without_direct_reads_large_messages_take_the_whole_schedule(pools):
    # mdring named: at 128 KB the cost model weighs it within 2% of recursive doubling
    assert all(
        pools.run(
            _without_direct_reads,
            4,
            rank_envs=_hosts(*"abab"),
            env={**SLOW_NET, "DDL_ALGO": "mdring"},
            timeout=90,
        )
    )


def _dies_in(rank, size, victim, collective):
    import os
    import threading
    import time

    import ddlcore

    comm = ddlcore.init()
    comm.barrier()
    x = np.ones((4 << 20) * (size if collective == "reduce_scatter" else 1), np.float32)
    assert comm.describe(collective, x.nbytes).host_path == "direct"
    if rank == victim:
        threading.Timer(0.1, os._exit, (3,)).start()
    t0 = time.monotonic()
    try:
        for _ in range(50):
            getattr(comm, collective)(x)
    except ddlcore.DDLError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("the dead rank was not noticed")


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather"])
def test_a_dead_rank_fails_the_host_staged_reduce_scatter_and_allgather(collective):
    """Rank 1 exits in the middle of a loop of host-staged calls (boards, rings): every
    survivor's call fails, naming itself and the call, long before DDL_TIMEOUT."""
    results = run_ranks(
        _dies_in,
        4,
        1,
        collective,
        may_die={1},
        rank_envs=_hosts(*"aabb"),
        env={**SLOW_NET, "DDL_ALGO": "mdring", "DDL_TIMEOUT": str(TIMEOUT_S)},
        timeout=120,
    )
    for rank in (0, 2, 3):
        message, elapsed = results[rank]
        assert elapsed < TIMEOUT_S / 2, (rank, elapsed, message)
        assert f"rank {rank}: {collective} #" in message, message


@pytest.mark.parametrize("nbytes", [4000, 4 << 20])
def test_a_dead_rank_fails_every_survivor_quickly(nbytes):
    """Its host neighbour sees it on the boards, the other host through TCP or through the
    abort notes passed on between the paths: nobody waits out DDL_TIMEOUT."""
    results = run_ranks(
        _dies,
        4,
        1,
        nbytes,
        may_die={1},
        rank_envs=_hosts(*"abab"),
        env={**SLOW_NET, "DDL_TIMEOUT": str(TIMEOUT_S)},
        timeout=90,
    )
    for rank in (0, 2, 3):
        message, elapsed = results[rank]
        assert elapsed < TIMEOUT_S / 2, (rank, elapsed, message)
        assert f"rank {rank}: allreduce #1" in message and "rank 1" in message, message


def _interrupted(rank, size):
    """Ctrl-C on rank 0 half-way through a pipelined allreduce (inside a boards call)."""
    import time

    import ddlcore
    from ddlcore.execution import hostcoll

    if rank == 0:
        real, calls = hostcoll.HostCollectives.run, []

        def run(self, *args, **kw):
            calls.append(1)
            if len(calls) == 6:  # a few segments in (the set-up barrier is call 1)
                raise KeyboardInterrupt
            return real(self, *args, **kw)

        hostcoll.HostCollectives.run = run
    comm = ddlcore.init()
    x = np.ones(4 << 20, np.float32)  # 16 MB: 4 segments
    t0 = time.monotonic()
    try:
        comm.allreduce(x)
    except KeyboardInterrupt:
        assert rank == 0
        try:
            comm.allreduce(x)
        except ddlcore.CommunicatorClosedError as exc:
            return str(exc), time.monotonic() - t0
        raise AssertionError("the interrupted communicator ran another call") from None
    except ddlcore.DDLError as exc:
        return str(exc), time.monotonic() - t0
    raise AssertionError("no failure")


def test_an_interrupt_mid_pipeline_breaks_the_communicator_and_tells_the_peers():
    results = run_ranks(
        _interrupted,
        4,
        rank_envs=_hosts(*"abab"),
        env={**SLOW_NET, "DDL_TIMEOUT": str(TIMEOUT_S)},
        timeout=120,
    )
    message, _ = results[0]
    assert "failed earlier (KeyboardInterrupt)" in message, message
    for rank in (1, 2, 3):
        message, elapsed = results[rank]
        assert elapsed < TIMEOUT_S / 2, (rank, elapsed, message)
        assert "KeyboardInterrupt" in message, (rank, message)


def _paths_taken(rank, size):
    """(node boards?, one-host boards?, the allreduce's choice, results right) for one
    communicator; the allreduce at a size the cost model pipelines (mdring, 2 segments)."""
    import ddlcore

    with ddlcore.init() as comm:
        ok = True
        for n in (0, 1, 7919, 4_200_001):
            x = np.random.default_rng(n + rank).standard_normal(n).astype(np.float32)
            want = sum(
                np.random.default_rng(n + r).standard_normal(n).astype(np.float32)
                for r in range(size)
            )
            ok &= np.allclose(comm.allreduce(x), want, rtol=1e-5, atol=1e-5)
        return (
            comm._node is not None,
            comm._host is not None,
            comm.describe("allreduce", 4_200_001 * 4).describe(),
            bool(ok),
        )


def test_host_collectives_off_runs_the_schedules_over_shm_pairs(pools):
    env = {**SLOW_NET, "DDL_HOST_COLLECTIVES": "off"}
    for node, host, text, ok in pools.run(
        _paths_taken, 4, rank_envs=_hosts(*"aabb"), env=env, timeout=120
    ):
        assert ok and not node and not host, (node, host)
        assert text.startswith("mdring") and "shared memory" not in text, text
    for node, host, _, ok in pools.run(
        _paths_taken, 3, env={"DDL_HOST_COLLECTIVES": "0"}, timeout=120
    ):
        assert ok and not node and not host


def test_ranks_with_different_host_collectives_settings_are_told(pools):
    envs = {0: {"DDL_HOST_COLLECTIVES": "off"}}
    with pytest.raises(Exception) as failed:
        pools.run(_paths_taken, 3, rank_envs=envs, env={"DDL_TIMEOUT": "20"}, timeout=60)
    text = str(failed.value)
    assert text.count("started with different settings") == 3, text
    assert "DDL_HOST_COLLECTIVES=off on ranks [0]" in text, text


def test_direct_with_host_collectives_off_is_refused(pools):
    env = {"DDL_HOST_COLLECTIVES": "off", "DDL_ALGO": "direct", "DDL_TIMEOUT": "20"}
    with pytest.raises(Exception) as failed:
        pools.run(_paths_taken, 2, env=env, timeout=60)
    assert str(failed.value).count("DDL_HOST_COLLECTIVES=off turns off") == 2, failed.value
