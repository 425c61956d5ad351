"""The topology a job finds at init: hosts told apart by DDL_HOST_ID, uneven hosts, a given box,
the link probe; every rank must end with the same box and links (they choose algorithms alike).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import run_ranks


def _topology(rank, size):
    import ddlcore

    with ddlcore.init() as comm:
        x = np.random.default_rng(rank).standard_normal(10_007).astype(np.float32)
        y = comm.allreduce(x)
        xs = [np.random.default_rng(r).standard_normal(10_007).astype(np.float32) for r in range(size)]
        np.testing.assert_allclose(y, np.sum(xs, axis=0), rtol=1e-4, atol=1e-4)
        t = comm.topology
        return (t.dims, t.order, t.levels, t.bw, t.lat, t.note,
                comm.describe("allreduce", 64 << 20).algorithm)


def _hosts(*names):
    return {r: {"DDL_HOST_ID": h} for r, h in enumerate(names)}


def test_interleaved_hosts_make_a_box_in_host_order():
    res = run_ranks(_topology, 4, rank_envs=_hosts("a", "b", "a", "b"),
                    env={"DDL_LINK_BW": "5e9,1e8"}, timeout=90)
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


def _expect_split_error(rank, size):
    import time

    import ddlcore

    with pytest.raises(ValueError, match="splits a host"):
        ddlcore.init()
    if rank == 0:  # its process serves the store: let the others' last replies go out first
        time.sleep(1.0)
    return True


def test_given_box_that_splits_a_host_is_an_error_on_every_rank():
    assert all(run_ranks(_expect_split_error, 4, rank_envs=_hosts("a", "a", "b", "b"),
                         env={"DDL_TOPOLOGY": "4x1", "DDL_TIMEOUT": "20"}, timeout=60))


def test_probe_measures_links_and_every_rank_reads_the_same():
    res = run_ranks(_topology, 4, env={"DDL_TOPOLOGY": "2x2", "DDL_LINK_PROBE": "1"}, timeout=90)
    assert len(set(res)) == 1
    dims, _, _, bw, lat, _, _ = res[0]
    assert dims == (2, 2)
    assert all(b > 1e6 for b in bw) and all(0 < t < 0.1 for t in lat)
