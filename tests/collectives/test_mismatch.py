"""Ranks that call different collectives (kind, count, dtype, op or root) get
CollectiveMismatchError on EVERY rank, on every path, transport and algorithm, within the
timeout: never a silent wrong result, a timeout or a hang (`ddlcore.algorithms.agreement`).

One job runs many cases: a mismatch breaks the communicator, so each case makes a new one with
``ddlcore.init()``; the worlds of one size share their processes (`pools`). The schedules' agreement properties are also checked symbolically
for every algorithm, world size and count (no processes)."""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest

from tests.collectives.test_collectives import _transport_ready
from tests.harness import run_ranks

TIMEOUT_S = 20.0

# (name, the call of the ranks that agree, the call of the rank that differs, which rank
# differs: "last" or "middle"). A call is (collective, count, dtype, op, root).
F32, I32 = "float32", "int32"
CASES = [
    (
        "broadcast root",
        ("broadcast", 1000, F32, None, 0),
        ("broadcast", 1000, F32, None, 1),
        "middle",
    ),
    (
        "broadcast root, root calls another",
        ("broadcast", 1000, F32, None, 0),
        ("broadcast", 1000, F32, None, 1),
        "first",
    ),
    ("count", ("allreduce", 1000, F32, "sum", 0), ("allreduce", 1003, F32, "sum", 0), "last"),
    ("count 0", ("allreduce", 5, F32, "sum", 0), ("allreduce", 0, F32, "sum", 0), "middle"),
    ("count 1", ("allreduce", 1, F32, "sum", 0), ("allreduce", 2, F32, "sum", 0), "last"),
    ("dtype", ("allreduce", 1000, F32, "sum", 0), ("allreduce", 1000, I32, "sum", 0), "last"),
    ("op", ("allreduce", 1000, F32, "sum", 0), ("allreduce", 1000, F32, "max", 0), "middle"),
    (
        "allreduce vs allgather",
        ("allreduce", 999, F32, "sum", 0),
        ("allgather", 333, F32, None, 0),
        "last",
    ),
    (
        "allreduce vs broadcast",
        ("allreduce", 1000, F32, "sum", 0),
        ("broadcast", 1000, F32, None, 0),
        "middle",
    ),
    (
        "allreduce vs barrier",
        ("allreduce", 1000, F32, "sum", 0),
        ("barrier", 0, F32, None, 0),
        "last",
    ),
    (
        "reduce_scatter vs allreduce",
        ("reduce_scatter", 996, F32, "sum", 0),
        ("allreduce", 996, F32, "sum", 0),
        "first",
    ),
    (
        "reduce_scatter count",
        ("reduce_scatter", 996, F32, "sum", 0),
        ("reduce_scatter", 1008, F32, "sum", 0),
        "middle",
    ),
    ("allgather dtype", ("allgather", 100, F32, None, 0), ("allgather", 100, I32, None, 0), "last"),
    ("broadcast count", ("broadcast", 70, F32, None, 0), ("broadcast", 77, F32, None, 0), "last"),
    # an integer avg runs as a sum of int64s (`ddlcore.execution.int_avg`): its call still differs
    (
        "int32 avg vs int64 sum",
        ("allreduce", 1000, I32, "avg", 0),
        ("allreduce", 1000, "int64", "sum", 0),
        "last",
    ),
    # 8.4 MB: the host-staged allreduce runs in pipelined segments (`host_staged`)
    (
        "count, pipelined",
        ("allreduce", 2_100_000, F32, "sum", 0),
        ("allreduce", 2_100_001, F32, "sum", 0),
        "middle",
    ),
]


def _differs(rank: int, size: int, which: str) -> bool:
    return rank == {"first": 0, "middle": size // 2, "last": size - 1}[which]


def _call(comm, rank: int, spec) -> None:
    collective, count, dtype, op, root = spec
    x = np.random.default_rng(rank).standard_normal(count).astype(dtype) + 1
    if collective == "allreduce":
        comm.allreduce(x, op=op)
    elif collective == "reduce_scatter":
        comm.reduce_scatter(x[: count - count % comm.size], op=op)
    elif collective == "allgather":
        comm.allgather(x)
    elif collective == "broadcast":
        comm.broadcast(x, root=root)
    else:
        comm.barrier()


def outcome(call) -> tuple[str, str, float]:
    """``call(comm)`` on a new communicator (a mismatch breaks it): (error class, message,
    seconds)."""
    import ddlcore

    comm = ddlcore.init()
    try:
        t0 = time.monotonic()
        try:
            # Every pair connected, in step. A rank still waiting for the last message of
            # this one may already hear of a peer's failure in the next (an abort overtakes
            # the data), and raise here: still the mismatch's error.
            comm.allreduce(np.ones(8, np.float32))
            call(comm)
        except ddlcore.DDLError as exc:
            return type(exc).__name__, str(exc), time.monotonic() - t0
        return "no error", "", time.monotonic() - t0
    finally:
        comm.close()


def _mismatch_cases(rank, size, names):
    """Each case on a new communicator: (error class, message, seconds) per case name."""
    out = {}
    for name, agreeing, differing, which in CASES:
        if name in names:
            spec = differing if _differs(rank, size, which) else agreeing
            out[name] = outcome(lambda comm, spec=spec: _call(comm, rank, spec))
    return out


def _check(results, names) -> None:
    for rank, got in enumerate(results):
        for name in names:
            cls, message, elapsed = got[name]
            assert cls == "CollectiveMismatchError", f"rank {rank}, {name}: {cls}: {message}"
            assert elapsed < TIMEOUT_S / 2, f"rank {rank}, {name}: {elapsed:.1f} s: {message}"


ALL = [c[0] for c in CASES if c[0] != "count, pipelined"]
# Each world runs every case once; the algorithms are forced (DDL_ALGO) or the cost model's.
WORLDS = [
    ("shm", "auto", 2),
    ("shm", "auto", 3),  # the boards (one host)
    ("shm", "ring", 2),
    ("shm", "ring", 3),  # schedules over the shm transport
    ("shm", "rhd", 3),
    ("shm", "rd", 4),
    ("tcp", "auto", 2),
    ("tcp", "auto", 3),
    ("tcp", "ring", 3),
    ("tcp", "mdring", 3),
    ("tcp", "rhd", 2),
    ("tcp", "rhd", 3),
    ("tcp", "rd", 3),
    ("tcp", "rd", 4),
    ("ucx", "auto", 3),
    ("mpi", "auto", 2),
    ("mpi", "ring", 3),
]


@pytest.mark.parametrize("transport,algo,nprocs", WORLDS)
def test_mismatch_raises_on_every_rank(transport, algo, nprocs, pools):
    _transport_ready(transport)
    env = {
        "DDL_TIMEOUT": str(TIMEOUT_S),
        "DDL_ALGO": algo,
        "DDL_CHUNK_BYTES": "1024",
        "DDL_TRANSPORT": transport,
    }
    if transport == "mpi":
        results = run_ranks(_mismatch_cases, nprocs, ALL, env=env, timeout=240, launcher="mpiexec")
    else:
        results = pools.run(_mismatch_cases, nprocs, ALL, env=env, timeout=240)
    _check(results, ALL)


def _pattern_case(rank, size, pattern, call_a, call_b):
    """One call per rank, ``call_a`` where ``pattern`` says "A", else ``call_b``, on a fresh
    communicator whose pairs connect on first use: (error class, message, seconds)."""
    import ddlcore

    comm = ddlcore.init()
    try:
        t0 = time.monotonic()
        try:
            _call(comm, rank, call_a if pattern[rank] == "A" else call_b)
        except ddlcore.DDLError as exc:
            return {pattern: (type(exc).__name__, str(exc), time.monotonic() - t0)}
        return {pattern: ("no error", "", time.monotonic() - t0)}
    finally:
        comm.close()


# Several ranks on each side: the rank that detects the mismatch aborts only its own pairs, so
# ranks blocked on one another elsewhere learn of it from the ranks that pass it on (`links`),
# and a rank whose first step connects to a rank that already left reads its note.
_AAABBB = ("AAABBB", ("allreduce", 1, F32, "sum", 0), ("broadcast", 1, F32, None, 0))
_AABB = ("AABB", ("barrier", 0, F32, None, 0), ("allreduce", 60000, F32, "sum", 0))
PATTERN_WORLDS = [
    ("tcp", "auto", *_AABB),
    ("shm", "rd", *_AABB),
    ("tcp", "auto", *_AAABBB),
    ("shm", "rd", *_AAABBB),
]


@pytest.mark.parametrize("transport,algo,pattern,call_a,call_b", PATTERN_WORLDS)
def test_mismatch_of_groups_raises_on_every_rank(transport, algo, pattern, call_a, call_b, pools):
    _transport_ready(transport)
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_ALGO": algo, "DDL_TRANSPORT": transport}
    results = pools.run(_pattern_case, len(pattern), pattern, call_a, call_b, env=env, timeout=120)
    _check(results, [pattern])


def _late_rank_case(rank, size, where, late_call):
    """Ranks 1 and 2 disagree (allreduce counts 1 and 2), fail and close; only then does rank
    0 make its first call (``late_call``: the same allreduce, or a send to rank 1), whose
    first message connects to rank 1, which is gone. (error class, message) on each rank."""
    import pathlib

    import ddlcore

    comm = ddlcore.init()
    try:
        if rank == 0:
            deadline = time.monotonic() + TIMEOUT_S
            while not all((pathlib.Path(where) / f"closed{r}").exists() for r in (1, 2)):
                assert time.monotonic() < deadline, "ranks 1 and 2 did not close"
                time.sleep(0.01)
        try:
            if rank == 0 and late_call == "send":
                comm.send(np.ones(3, np.float32), dest=1, tag=7)
            else:
                comm.allreduce(np.ones(2 if rank == 2 else 1, np.float32))
        except ddlcore.DDLError as exc:
            return type(exc).__name__, str(exc)
        return "no error", ""
    finally:
        comm.close()
        (pathlib.Path(where) / f"closed{rank}").touch()


@pytest.mark.parametrize(
    "transport,late_call",
    [("tcp", "allreduce"), ("shm", "allreduce"), ("ucx", "allreduce"), ("tcp", "send")],
)
def test_a_rank_that_comes_after_the_others_left_hears_why(transport, late_call, pools, tmp_path):
    """Pairs connect on first use: a rank whose first message goes to a rank that already
    failed and closed reads that rank's note of its abort (`ddlcore.job.abort_notes`), and
    raises the mismatch, not a "could not connect" that blames the rank."""
    _transport_ready(transport)
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_ALGO": "ring", "DDL_TRANSPORT": transport}
    results = pools.run(_late_rank_case, 3, str(tmp_path), late_call, env=env, timeout=120)
    for rank, (cls, message) in enumerate(results):
        assert cls == "CollectiveMismatchError", f"rank {rank}: {cls}: {message}"
    assert "rank 2 aborted" in results[0][1], results[0][1]  # the rank that saw it first


def _hosts(*names):
    return {r: {"DDL_HOST_ID": h} for r, h in enumerate(names)}


HOST_CASES = [
    "broadcast root",
    "count",
    "count 0",
    "op",
    "allreduce vs allgather",
    "reduce_scatter count",
    "count, pipelined",
]


@pytest.mark.parametrize("algo", ["auto", "mdring"])
def test_mismatch_across_hosts(algo, pools):
    """Two "hosts" of two ranks (DDL_HOST_ID): the boards within each, tcp between them,
    mdring's host-staged path or the schedules."""
    env = {
        "DDL_TIMEOUT": str(TIMEOUT_S),
        "DDL_ALGO": algo,
        "DDL_TRANSPORT": "auto:tcp",
        "DDL_LINK_BW": "5e9,1e8",
        "DDL_LINK_LAT": "1e-6,1e-3",
    }
    results = pools.run(
        _mismatch_cases, 4, HOST_CASES, env=env, timeout=240, rank_envs=_hosts("a", "a", "b", "b")
    )
    _check(results, HOST_CASES)


def _symbolic_worlds():
    from ddlcore.algorithms import ALGORITHMS

    for size in (2, 3, 4, 5, 8):
        for collective, algos in ALGORITHMS.items():
            for name in algos:
                for count in (0,) if collective == "barrier" else (0, 1, 2, 7, 1000):
                    yield size, collective, name, count


def test_schedules_make_first_contact_and_pair_up():
    """After `agreement.agreed`, every rank's first step sends slot 0 to rank + 1 and its first
    receive is slot 0 from rank - 1; and every message sent is received (same slot, same
    count) by its peer."""
    from ddlcore.algorithms import ALGORITHMS, agreement
    from ddlcore.algorithms.schedule import Kind
    from ddlcore.planning import topology

    for size, collective, name, count in _symbolic_worlds():
        make = ALGORITHMS[collective][name]
        topo = topology.flat(size, level="host")
        n = count * size if collective in ("reduce_scatter", "alltoall") else count
        # alltoallv: rank s sends (s + 2 d) % 3 * count elements to rank d (some none)
        splits = [[(s + 2 * d) % 3 * count for d in range(size)] for s in range(size)]

        def mk(
            r,
            make=make,
            topo=topo,
            n=n,
            collective=collective,
            size=size,
            count=count,
            splits=splits,
        ):
            if collective == "barrier":
                return make(r, size)
            if collective in ("broadcast", "reduce", "gather", "scatter"):
                return make(r, size, n, 4, 64, count % size)
            if collective == "alltoall":
                return make(r, size, n, 4, 64)
            if collective == "alltoallv":
                return make(r, size, splits[r], [row[r] for row in splits], 4, 64)
            return make(r, size, n, 4, 64, topo)

        complete = agreement.natural_completeness(collective, n, size)
        sent, got = defaultdict(list), defaultdict(list)
        for r in range(size):
            sched = agreement.agreed(mk, r, size, complete)
            where = (size, collective, name, count, r)
            assert agreement.sends_first(sched) and agreement.waits_first(sched), where
            if not complete:  # every rank waits for every round of the dissemination
                froms = {s.peer for s in sched.steps if s.kind == Kind.RECV and s.count == 0}
                assert froms == {(r - d) % size for d in agreement.dissemination_rounds(size)}
            for s in sched.steps:
                if s.kind == Kind.SEND:
                    sent[(r, s.peer)].append((s.slot, s.count))
                elif s.kind != Kind.COPY:
                    got[(s.peer, r)].append((s.slot, s.count))
        for key in set(sent) | set(got):
            assert sorted(sent[key]) == sorted(got[key]), (size, collective, name, count, key)
            assert len({slot for slot, _ in sent[key]}) == len(sent[key]), key
