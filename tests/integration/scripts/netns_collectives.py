"""One rank of tests/integration/test_netns.py: collectives across namespaces checked against NumPy.

Run inside an emulated host (a network namespace) with the rendezvous variables and DDL_ALGO set;
argv[1] is the number of ranks per host (block placement). Every rank makes every rank's random
input from a per-rank seed, so it can compute the NumPy answer on its own; exits non-zero with a
traceback on any mismatch.
"""

import hashlib
import sys

import numpy as np

import ddlcore
from ddlcore.algorithms import ALGORITHMS
from ddlcore.config import get

COUNTS = (1 << 20, 1_000_003)  # 4 MB of float32, and an odd, prime count


def inputs(count: int, size: int) -> list[np.ndarray]:
    return [
        np.random.default_rng(1000 * count + r).standard_normal(count).astype(np.float32)
        for r in range(size)
    ]


def check(comm, got: np.ndarray, want: np.ndarray, what: str, same: bool = True) -> None:
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=what)
    if not same:
        return
    # The contract: the same bits on every rank, not merely close.
    digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(got).tobytes()).digest(), np.uint8)
    digests = comm.allgather(digest).reshape(comm.size, -1)
    assert (digests == digests[0]).all(), f"{what}: ranks disagree on the result's bits"


def main() -> None:
    ranks_per_host = int(sys.argv[1])
    algo = get("DDL_ALGO")
    with ddlcore.init() as comm:
        p, rank = comm.size, comm.rank
        host = rank // ranks_per_host
        assert comm.nhosts == p // ranks_per_host, (comm.nhosts, p, ranks_per_host)
        assert (comm.local_rank, comm.local_size) == (rank % ranks_per_host, ranks_per_host)
        want = {
            peer: "shm" if peer // ranks_per_host == host else "tcp"
            for peer in range(p)
            if peer != rank
        }
        assert comm.transports == want, f"transports {comm.transports}, expected {want}"
        for count in COUNTS:
            xs = inputs(count, p)
            exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
            if algo in ALGORITHMS["allreduce"]:
                check(comm, comm.allreduce(xs[rank], op="sum"), exact, f"allreduce sum {count}")
                check(comm, comm.allreduce(xs[rank], op="avg"), exact / p, f"allreduce avg {count}")
            if algo in ALGORITHMS["reduce_scatter"]:
                k = count // p
                k -= k % 2 == 0  # an odd share, so no chunking divides it evenly
                got = comm.reduce_scatter(xs[rank][: k * p], op="sum")
                check(
                    comm,
                    got,
                    exact[rank * k : (rank + 1) * k],
                    f"reduce_scatter {k * p}",
                    same=False,
                )
            if algo in ALGORITHMS["allgather"]:
                check(comm, comm.allgather(xs[rank]), np.concatenate(xs), f"allgather {count}")
        print(f"rank {rank} on host {host}: {algo} ok, transports {sorted(set(want.values()))}")


if __name__ == "__main__":
    main()
