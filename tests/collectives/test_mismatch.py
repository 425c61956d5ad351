"""Ranks that call different collectives (kind, count, dtype, op or root) get
CollectiveMismatchError on EVERY rank, on every path, transport and algorithm, within the
timeout: never a silent wrong result, a timeout or a hang (`ddlcore.algorithms.agreement`); and
every message names both calls (collective, count in elements, dtype, op, root: `NAMED`).

One job runs many cases: a mismatch breaks the communicator, so each case makes a new one with
``ddlcore.init()``; the worlds of one size share their processes (`pools`). The schedules' agreement properties are also checked symbolically
for every algorithm, world size and count (no processes)."""

from __future__ import annotations

import re
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
    # what the boards' kernels cannot tell apart (avg runs as sum, bool as uint8) still differs
    ("avg vs sum", ("allreduce", 1000, F32, "avg", 0), ("allreduce", 1000, F32, "sum", 0), "last"),
    (
        "bool vs uint8",
        ("allreduce", 1000, "bool", "max", 0),
        ("allreduce", 1000, "uint8", "max", 0),
        "middle",
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
    if dtype == "bool":
        x = np.random.default_rng(rank).standard_normal(count) > 0
    else:
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


# What every rank's message must say, beside its own call: both calls' dtypes, ops, counts,
# kinds or roots, by name and in elements (the other rank's call read from its check word or
# board entry, or from the abort note of the rank that read it). Where the other call cannot be
# read from a check word, its own words only: a barrier (no count to start from) beside an
# allreduce; an allgather whose count is no share of the allreduce's (333 of 999 at 4 ranks).
NAMED = {
    "broadcast root": ["root 0", "root 1"],
    "broadcast root, root calls another": ["root 0", "root 1"],
    "count": ["1000 x float32", "1003 x float32"],
    "count 0": ["5 x float32", "0 x float32"],
    "count 1": ["1 x float32", "2 x float32"],
    "dtype": ["float32", "int32"],
    "op": ["float32, sum", "float32, max"],
    "allreduce vs allgather": [],
    "allreduce vs broadcast": ["allreduce", "broadcast"],
    "allreduce vs barrier": ["barrier"],
    "reduce_scatter vs allreduce": ["reduce_scatter", "allreduce"],
    "reduce_scatter count": ["996 x float32", "1008 x float32"],
    "allgather dtype": ["100 x float32", "100 x int32"],
    "broadcast count": ["70 x float32", "77 x float32"],
    "int32 avg vs int64 sum": ["avg", "int32", "int64, sum"],
    "avg vs sum": ["float32, avg", "float32, sum"],
    "bool vs uint8": ["bool, max", "uint8, max"],
    # across hosts the boards' phases of one segment may be what differs first: named by it
    "count, pipelined": ["float32, sum"],
}
# How the messages once named what they could not: codes and byte counts for elements.
UNNAMED = re.compile(r"dtype code|op code|dtype_code|op_code")


def _check(results, names) -> None:
    for rank, got in enumerate(results):
        for name in names:
            cls, message, elapsed = got[name]
            where = f"rank {rank}, {name}: {cls}: {message}"
            assert cls == "CollectiveMismatchError", where
            assert elapsed < TIMEOUT_S / 2, f"rank {rank}, {name}: {elapsed:.1f} s: {message}"
            assert not UNNAMED.search(message), where
            for words in NAMED.get(name, []):
                assert words in message, f"{words!r} not named: {where}"


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


def test_ddl_debug_names_both_calls(pools):
    """DDL_DEBUG's full comparison (every rank's call allgathered before it runs) names every
    rank's call as the other checks do."""
    names = ["dtype", "op", "bool vs uint8", "broadcast root", "count"]
    env = {"DDL_TIMEOUT": str(TIMEOUT_S), "DDL_DEBUG": "1", "DDL_TRANSPORT": "tcp"}
    results = pools.run(_mismatch_cases, 3, names, env=env, timeout=240)
    _check(results, names)
    for got in results:
        assert "DDL_DEBUG check" in got["dtype"][1], got["dtype"][1]


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
    from ddlcore import topology
    from ddlcore.algorithms import ALGORITHMS, agreement
    from ddlcore.algorithms.schedule import Kind

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


def test_another_ranks_call_is_named_from_its_check_word():
    """`check_words.describe_check` (what a rank says of a message whose check word is not its own)
    and the boards' `describe_entry` (of a rank's board entry, whose kernel codes say sum for
    avg and uint8 for bool) name the call behind a check word; no processes."""
    from ddlcore.transports.shm import board_calls

    from ddlcore import calls
    from ddlcore.execution import check_words
    from ddlcore.execution._frontend import check_word
    from ddlcore.execution.paths.base import check_word as call_check

    rng = np.random.default_rng(5)
    for _ in range(200):  # the transports' twin of the check word is the check word
        fields = (int(rng.integers(1, 13)), int(rng.integers(0, 256)), int(rng.integers(0, 256)))
        more = (
            int(rng.integers(0, 1 << 40)),
            int(rng.integers(-9, 64)),
            int(rng.integers(0, 1 << 22)),
        )
        assert board_calls.check_word(*fields, *more) == check_word(*fields, *more)

    def call(collective, count, dtype, op=None, root=0):
        x = np.ones(count, dtype)
        return calls.prepare(collective, x, op, None, root, 3, rank=root)

    mine = call("allreduce", 1000, np.float32, "sum")
    theirs = {
        "allreduce(1000 x int32, max)": call("allreduce", 1000, np.int32, "max"),
        "allreduce(1000 x float32, avg)": call("allreduce", 1000, np.float32, "avg"),
        "allreduce(1000 x bool, max)": call("allreduce", 1000, bool, "sum"),
        "allreduce(1003 x float32, sum)": call("allreduce", 1003, np.float32, "sum"),
        "broadcast(1000 x float32, root 2)": call("broadcast", 1000, np.float32, None, 2),
        "allgather(333 x float32)": call("allgather", 333, np.float32),
        "reduce(1000 x uint8, min, root 1)": call("reduce", 1000, np.uint8, "min", 1),
    }
    for named, other in theirs.items():
        for chunk in (0, 1024):
            assert (
                check_words.describe_check(call_check(other, chunk_bytes=chunk), mine, 3, chunk)
                == named
            )
    assert check_words.describe_check(call_check(mine, chunk_bytes=0), mine, 3, 1024) is None
    assert calls.describe_fingerprint(calls.fingerprint(theirs["allreduce(1000 x bool, max)"])) == (
        "allreduce(1000 x bool, max)"
    )

    kinds = board_calls.BoardKind
    for other, entry, named in [
        (call("allreduce", 7, np.float32, "avg"), (1, 2, 0, 0, 7), "allreduce(7 x float32, avg)"),
        (call("allreduce", 7, np.float32, "sum"), (1, 2, 0, 0, 7), "allreduce(7 x float32, sum)"),
        (call("allreduce", 7, bool, "prod"), (1, 5, 2, 0, 7), "allreduce(7 x bool, min)"),
        (call("allreduce", 7, np.uint8, "min"), (1, 5, 2, 0, 7), "allreduce(7 x uint8, min)"),
        (call("broadcast", 7, bool, None, 1), (4, 5, 0, 1, 7), "broadcast(7 x bool, root 1)"),
    ]:
        check = call_check(other, kinds.of(other.collective))
        assert board_calls.describe_entry(entry, check) == named
    assert board_calls.describe_entry((5, 0, 0, 0, 0), 1) == "barrier()"
    # A segment of a host phase: its check word is the whole call's; the entry's names then.
    assert board_calls.describe_entry((6, 2, 0, 0, 50), 12345) == (
        "allreduce's host reduce-scatter(50 x float32, sum)"
    )
