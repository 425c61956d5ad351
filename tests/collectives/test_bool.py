"""bool arrays through every reducing collective and the ones that move bytes, on every path
of one host (the boards, the schedules over tcp and shm, several algorithms), against the NumPy
oracle: sum and max are logical or, prod and min logical and (torch.distributed gloo's results,
``tests/integration/test_torch_backend.py`` compares them with gloo itself), every result byte 0
or 1, avg a TypeError naming the op. Sizes 0, 1, primes and counts no world size divides;
random data, mostly True for the ands, mostly False for the ors, so both results occur."""

from __future__ import annotations

import numpy as np
import pytest

from tests.collectives.test_collectives import _transport_ready

COUNTS = [0, 1, 2, 3, 7, 13, 101, 1009, 4099]
OPS = ["sum", "prod", "min", "max"]


def _inputs(count: int, size: int, case: int, op: str) -> list[np.ndarray]:
    """Every rank's input of one case (each rank builds them all: the same seeds)."""
    p_true = 0.3 if op in ("sum", "max") else 0.95
    return [np.random.default_rng([case, r, count]).random(count) < p_true for r in range(size)]


def _bool_cases(rank: int, size: int) -> list[str]:
    """Every case on one communicator; the list of what failed (empty: all passed)."""
    from ddlcore.kernels import reference

    import ddlcore

    failed: list[str] = []

    def check(got, want, what: str) -> None:
        got = np.asarray(got)
        if got.dtype != np.bool_ or not np.array_equal(got, want):
            failed.append(f"{what}: {got!r} != {want!r}")
        elif got.size and got.view(np.uint8).max() > 1:
            failed.append(f"{what}: bytes {got.view(np.uint8)!r} are not 0 or 1")

    with ddlcore.init() as comm:
        for case, count in enumerate(COUNTS):
            for op in OPS:
                xs = _inputs(count, size, case, op)
                want = reference.reduce_ref(xs, op)
                what = f"{op}, {count} elements"
                check(comm.allreduce(xs[rank], op=op), want, f"allreduce {what}")
                out = xs[rank].copy()
                comm.allreduce(out, op=op, out=out)
                check(out, want, f"allreduce in place {what}")
                check(comm.allreduce_async(xs[rank], op=op).wait(), want, f"async {what}")
                root = count % size
                got = comm.reduce(xs[rank], op=op, root=root)
                if rank == root:
                    check(got, want, f"reduce to {root} {what}")
                blocks = _inputs(count * size, size, case + 100, op)
                whole = reference.reduce_ref(blocks, op)
                check(
                    comm.reduce_scatter(blocks[rank], op=op),
                    whole[rank * count : (rank + 1) * count],
                    f"reduce_scatter {what}",
                )
            xs = _inputs(count, size, case, "sum")
            check(comm.allgather(xs[rank]), np.concatenate(xs), f"allgather {count}")
            y = xs[rank].copy()
            comm.broadcast(y, root=size - 1)
            check(y, xs[size - 1], f"broadcast {count}")
        try:
            comm.allreduce(np.ones(3, bool), op="avg")
            failed.append("avg of bool did not raise")
        except TypeError as exc:
            if "op='avg'" not in str(exc):
                failed.append(f"avg of bool: {exc}")
        flag = comm.allreduce(np.array([rank == size - 1]), op="max")  # a stop flag
        check(flag, np.array([True]), "stop flag")
    return failed


WORLDS = [
    ("shm", "auto", 2),  # the boards
    ("shm", "auto", 3),
    ("shm", "ring", 3),  # the schedules over shm
    ("tcp", "auto", 2),  # the cost model's, and the links' native runner
    ("tcp", "rhd", 3),
    ("tcp", "mdring", 4),
]


@pytest.mark.parametrize("transport,algo,nprocs", WORLDS)
def test_bool_collectives(transport, algo, nprocs, pools):
    _transport_ready(transport)
    env = {
        "DDL_TRANSPORT": transport,
        "DDL_ALGO": algo,
        "DDL_CHUNK_BYTES": "1024",
        "DDL_TIMEOUT": "60",
    }
    results = pools.run(_bool_cases, nprocs, env=env, timeout=300)
    for rank, failed in enumerate(results):
        assert not failed, f"rank {rank}: " + "\n".join(failed[:10])


def test_bool_arrays_alone():
    """A world of one, and the array-level kernel wrapper: the same results, avg refused."""
    from ddlcore.kernels import reduce_arrays, reference

    import ddlcore

    a = np.array([0, 0, 1, 1], bool)
    b = np.array([0, 1, 0, 1], bool)
    for op, want in (("sum", [0, 1, 1, 1]), ("max", [0, 1, 1, 1]), ("prod", [0, 0, 0, 1])):
        got = reduce_arrays(a.copy(), b, op)
        assert got.dtype == np.bool_ and got.view(np.uint8).tolist() == want, (op, got)
        assert np.array_equal(reference.reduce_ref([a, b], op), np.array(want, bool)), op
    assert reduce_arrays(a.copy(), b, "min").tolist() == [False, False, False, True]
    with pytest.raises(TypeError, match="avg"):
        reduce_arrays(a.copy(), b, "avg")
    with ddlcore.init(rank=0, size=1) as comm:
        assert np.array_equal(comm.allreduce(a, op="sum"), a)
        with pytest.raises(TypeError, match="op='avg'"):
            comm.allreduce(a, op="avg")
