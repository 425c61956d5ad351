"""Every algorithm on several box shapes (np up to 8, real processes over shared memory): the
collective matrix's thin slice (every dtype, so every element size at every count; every op;
against NumPy), and identical results on every rank. The full dtype x op cross product runs in
test_collectives.py; the reductions themselves are the kernels' tests.

``DDL_TOPOLOGY`` makes one host's ranks a box, so mdring runs its phases along each dimension;
``DDL_ALGO`` forces the algorithm. The symbolic tests (tests/unit/test_schedules.py) cover many
more shapes and sizes without processes; these prove the engine and transports run them. The
worlds of one size share their processes (`pools`): what runs in them is the subject here.
"""

from __future__ import annotations

import pytest

from tests.collectives import matrix

BOXES = {"2x2": 4, "2x3": 6, "2x2x2": 8, "4x2": 8}
ALGOS = ["ring", "mdring", "rhd", "rd"]
# Small counts keep np = 8 on two cores quick; 0, 1, primes and counts not divisible by np stay
# (3, 5, 7: fewer elements than ranks, some ranks' parts empty; 13, 101, 1009: more, uneven).
COUNTS = "0,1,3,5,7,13,101,1009"


def _collectives(algo: str) -> list[str]:
    return ["allreduce"] if algo == "rd" else ["allreduce", "reduce_scatter", "allgather"]


def _run_all(rank, size, collectives):
    import ddlcore

    out = {}
    out.update(matrix.run_matrix(rank, size, collectives, thin=True))
    with ddlcore.init() as comm:
        chosen = {c: comm.describe(c, 4096).algorithm for c in collectives}
        comm.barrier()  # rank 0 serves the store: it must not exit while others still set up
    return out, chosen


def _run_pipelined(rank, size):
    import ddlcore

    digests = matrix.run_matrix(rank, size, "allreduce", thin=True)
    with ddlcore.init() as comm:
        choice = comm.describe("allreduce", 4096)
        sched = comm._schedule_path.schedule("allreduce", 1024, 4, 0)[1]
        assert len(sched.streams()) > 1, sched  # the engine ran it on several threads
        comm.barrier()
    return digests, choice


# Only mdring's phases depend on the box's shape (ring and rhd see np ranks on one host), so
# 4x2 runs for mdring alone.
# Eight ranks on two cores: slow (`-m "not slow"` leaves them out; CI runs them).
SLOW = pytest.mark.slow


def _case(*values, nprocs: int):
    return pytest.param(*values, marks=[SLOW] if nprocs >= 8 else [])


CASES = [_case(a, b, nprocs=BOXES[b]) for a in ALGOS for b in BOXES if b != "4x2" or a == "mdring"]


@pytest.mark.parametrize("algo,box", CASES)
def test_algorithm_on_box(algo, box, pools):
    nprocs = BOXES[box]
    env = {
        "DDL_ALGO": algo,
        "DDL_TOPOLOGY": box,
        "DDL_TRANSPORT": "shm",
        "DDL_CHUNK_BYTES": "256",
        "DDL_TIMEOUT": "60",
        "MATRIX_COUNTS": COUNTS,
    }
    results = pools.run(_run_all, nprocs, _collectives(algo), env=env, timeout=300)
    digests0, chosen = results[0]
    assert set(chosen.values()) == {algo}, chosen
    # every dtype at every count, for each collective (and every op on float32)
    assert len(digests0) > len(matrix.DTYPES) * len(COUNTS.split(",")) * len(chosen), digests0
    for rank in range(1, nprocs):
        digests = results[rank][0]
        differ = [
            case
            for case in digests0
            if not case.startswith("reduce_scatter") and digests[case] != digests0[case]
        ]
        assert not differ, f"rank {rank} differs from rank 0 in {differ[:5]}"


@pytest.mark.parametrize(
    "box,transport",
    [
        _case(b, t, nprocs=BOXES[b])
        for b, t in [("2x2", "shm"), ("2x2x2", "shm"), ("4x2", "shm"), ("2x2", "tcp")]
    ],
)
def test_mdring_pipelined_across_dimensions(box, transport, pools):
    """mdring's allreduce in segments whose phases overlap (one engine thread per stream):
    the matrix against NumPy, identical on every rank, on boxes of two and three dimensions."""
    nprocs = BOXES[box]
    env = {
        "DDL_ALGO": "mdring",
        "DDL_TOPOLOGY": box,
        "DDL_TRANSPORT": transport,
        "DDL_SEGMENTS": "3",
        "DDL_CHUNK_BYTES": "256",
        "DDL_TIMEOUT": "60",
        "MATRIX_COUNTS": COUNTS,
    }
    results = pools.run(_run_pipelined, nprocs, env=env, timeout=300)
    digests0, choice = results[0]
    assert choice.algorithm == "mdring" and choice.segments == 3, choice
    for rank in range(1, nprocs):
        differ = [case for case in digests0 if results[rank][0][case] != digests0[case]]
        assert not differ, f"rank {rank} differs from rank 0 in {differ[:5]}"
