"""The topology a job finds at init: hosts told apart by DDL_HOST_ID, uneven hosts, a given box,
the link probe; every rank must end with the same box and links (they choose algorithms alike).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import barrier, run_ranks


def _topology(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        x = np.random.default_rng(rank).standard_normal(10_007).astype(np.float32)
        y = comm.allreduce(x)
        xs = [
            np.random.default_rng(r).standard_normal(10_007).astype(np.float32) for r in range(size)
        ]
        np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-4, atol=1e-4)
        t = comm.topology
        return (
            t.dims,
            t.order,
            t.levels,
            t.bw,
            t.lat,
            t.note,
            comm.describe("allreduce", 64 << 20).algorithm,
        )


def _hosts(*names):
    return {r: {"DDL_HOST_ID": h} for r, h in enumerate(names)}


def test_interleaved_hosts_make_a_box_in_host_order():
    res = run_ranks(
        _topology,
        4,
        rank_envs=_hosts("a", "b", "a", "b"),
        env={"DDL_LINK_BW": "5e9,1e8"},
        timeout=90,
    )
    assert len(set(res)) == 1, "ranks disagree on the topology"
    dims, order, levels, bw, _, note, algo = res[0]
    assert dims == (2, 2) and order == (0, 2, 1, 3) and levels == ("host", "network")
    assert bw == (5e9, 1e8) and note == ""
    assert algo == "mdring"  # a slow network: the cost model keeps bytes off it


def test_uneven_hosts_run_a_flat_ring_and_say_why():
    res = run_ranks(_topology, 5, rank_envs=_hosts("a", "a", "a", "b", "b"), timeout=90)
    assert len(set(res)) == 1
    dims, _, _, _, _, note, _ = res[0]
    assert dims == (5,) and "[3, 2]" in note


def _expect_split_error(rank, size, answered):
    import ddlcore

    with pytest.raises(ValueError, match="splits a host"):
        ddlcore.init()
    answered.wait(50)  # rank 0's process serves the store: it stays until every rank has its error
    return True


def test_given_box_that_splits_a_host_is_an_error_on_every_rank():
    assert all(
        run_ranks(
            _expect_split_error,
            4,
            barrier(4),
            rank_envs=_hosts("a", "a", "b", "b"),
            env={"DDL_TOPOLOGY": "4x1", "DDL_TIMEOUT": "20"},
            timeout=60,
        )
    )


def test_probe_measures_links_and_every_rank_reads_the_same():
    res = run_ranks(_topology, 4, env={"DDL_TOPOLOGY": "2x2", "DDL_LINK_PROBE": "1"}, timeout=90)
    assert len(set(res)) == 1
    dims, _, _, bw, lat, _, _ = res[0]
    assert dims == (2, 2)
    assert all(b > 1e6 for b in bw) and all(0 < t < 0.1 for t in lat)


# --- cyclic placement: ranks dealt round-robin over the hosts (rank r on host r % H) ------------

# Links like 1 Gbit/s between hosts: auto and mdring run the host dimension on the boards.
SLOW_NET = {"DDL_LINK_BW": "5e9,1e8", "DDL_LINK_LAT": "1e-6,1e-3"}
# 0, 1, a prime, and a prime above the boards' 128 KB slots (direct reads); none divisible by P.
CYCLIC_COUNTS = (0, 1, 1009, 65_537)


def _cyclic_collectives(rank, size, hosts, thin=False):
    """Every collective on random data against NumPy, the digests of the results every rank
    shares (not reduce_scatter's) for the parent to compare across ranks; also where the rings
    go (rank order for ring, the box for mdring)."""
    from ddlcore.kernels import reference

    import ddlcore
    from ddlcore.algorithms import Kind
    from ddlcore.config import get
    from tests.collectives import matrix

    algo = get("DDL_ALGO")
    digests = {}
    with ddlcore.init() as comm:
        topo = comm.topology
        assert topo.dims == (size // hosts, hosts), topo.dims
        assert topo.order == tuple(sorted(range(size), key=lambda r: (r % hosts, r)))
        assert comm.nhosts == hosts and comm.local_rank == rank // hosts
        assert {q for q, t in comm.transports.items() if t == "shm"} == {
            q for q in range(size) if q % hosts == rank % hosts and q != rank
        }
        choice, sched = comm._schedule_path.schedule("allreduce", 100_000, 4, 0)
        peers = {s.peer for s in sched.steps if s.kind != Kind.COPY}
        if algo == "ring":
            assert choice.algorithm == "ring" and peers == {(rank - 1) % size, (rank + 1) % size}
            assert comm._node is None
        else:
            large = comm.describe("allreduce", 16 << 20)
            if algo in ("mdring", "auto"):
                assert large.algorithm == "mdring" and large.host_path == "direct", large
                assert comm._node is not None and comm._node.ranks == tuple(
                    range(rank % hosts, size, hosts)
                )
        for dtype in (np.float32, np.int64):
            name = np.dtype(dtype).name
            for count in CYCLIC_COUNTS:
                for op in matrix.OPS if dtype is np.float32 or not thin else ["sum"]:
                    case = f"allreduce {name} {op} count={count}"
                    digests[case] = matrix.allreduce_both_ways(comm, dtype, count, op)
                for op in ("sum", "max"):
                    xs = [matrix.random_input(dtype, count * size, r, 7, op) for r in range(size)]
                    got = comm.reduce_scatter(xs[rank], op=op)
                    want = reference.reduce_ref(xs, op)[rank * count : (rank + 1) * count]
                    case = f"reduce_scatter {name} {op} count={count}"
                    matrix.check_close(got, want, dtype, op, size, f"rank {rank}: {case}")
                xs = [matrix.random_input(dtype, count, r, 11, "sum") for r in range(size)]
                got = comm.allgather(xs[rank])
                np.testing.assert_array_equal(got, np.concatenate(xs))
                digests[f"allgather {name} count={count}"] = matrix.digest(got)
                root = (count + 1) % size
                x = xs[rank].copy()
                assert comm.broadcast(x, root=root) is x
                np.testing.assert_array_equal(x, xs[root])
    return digests


@pytest.mark.parametrize("algo", ["ring", "mdring", "rhd", "auto"])
@pytest.mark.parametrize("per_host,hosts", [(2, 2), (2, 3)], ids=["2x2", "2x3"])
def test_cyclic_placement_every_collective_and_algorithm(per_host, hosts, algo, pools):
    """Ranks 0, 2 on host a and 1, 3 on host b (2x2; 2x3: a b c a b c): mdring's box follows
    the hosts through a permutation of the ranks, the ring stays in rank order, results are
    right and bit-identical on every rank. Every op on int64 too under mdring (whose box the
    placement permutes); the other algorithms take sum on int64."""
    size = per_host * hosts
    results = pools.run(
        _cyclic_collectives,
        size,
        hosts,
        algo != "mdring",
        rank_envs=_hosts(*(f"h{r % hosts}" for r in range(size))),
        env={**SLOW_NET, "DDL_ALGO": algo, "DDL_TIMEOUT": "60"},
        timeout=300,
    )
    for rank in range(1, size):
        assert results[rank] == results[0], f"rank {rank} differs from rank 0"
