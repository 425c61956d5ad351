"""Where init pins the ranks that share a host (DDL_BIND): each on its block of the CPUs the
launcher gave them all, nowhere the launcher placed them itself or another job pinned its ranks,
never with DDL_BIND=none; a second init finds the same block and a split leaves it alone. Each
test's ranks keep their claims in a directory of the test's own (the host's is shared with
whatever else the suite runs at the time), gone once the last of them has closed."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from ddlcore.job import placement
from tests.harness import barrier, event, run_ranks


def _cpus():
    return sorted(os.sched_getaffinity(0))


def _claims_in(folder):
    placement.claims_dirs = lambda: [folder]


def _init_and_report(rank, size, claims, own=None):
    import ddlcore

    _claims_in(claims)
    if own is not None:  # the launcher placed this rank
        os.sched_setaffinity(0, own[rank])
    before = _cpus()
    with ddlcore.init() as comm:
        first = _cpus()
        sub = comm.split(rank % 2)
        after_split = _cpus()
        sub.close()
        xs = [np.random.default_rng(r).standard_normal(7) for r in range(size)]
        np.testing.assert_allclose(comm.allreduce(xs[rank]), np.sum(xs, axis=0))
    with ddlcore.init() as comm:  # a second world in the same process
        again = _cpus()
    assert _cpus() == before  # closing unpins
    return before, first, after_split, again


def _expected(size):
    """What `auto` gives each rank of one host, from the CPUs the test process has."""
    cpus = _cpus()
    if size > len(cpus) or placement.host_has_gpu():
        return [cpus] * size
    return placement.cpu_shares(size, cpus)


@pytest.mark.parametrize("size", [2, 3])
def test_each_local_rank_gets_a_block_of_its_own(size, tmp_path):
    claims = tmp_path / "claims"
    res = run_ranks(_init_and_report, size, str(claims))
    want = _expected(size)
    for rank, (before, first, after_split, again) in enumerate(res):
        assert before == _cpus()
        assert first == after_split == again == want[rank], (rank, res)
    assert not claims.exists()  # the last rank to release took the claims away


def test_bind_none_leaves_placement_to_the_kernel(tmp_path):
    res = run_ranks(_init_and_report, 2, str(tmp_path / "claims"), env={"DDL_BIND": "none"})
    assert all(seen == _cpus() for r in res for seen in r), res


def test_ranks_the_launcher_placed_stay_where_they_are(tmp_path):
    cpus = _cpus()
    own = {0: [cpus[0]], 1: cpus}  # as a launcher that bound rank 0 only
    res = run_ranks(_init_and_report, 2, str(tmp_path / "claims"), own)
    assert [r[1] for r in res] == [[cpus[0]], cpus], res
    assert all(r[0] == r[1] == r[2] == r[3] for r in res), res


def test_emulated_hosts_on_one_machine_share_its_cpus(tmp_path):
    # Host ids tell two hosts apart, but their ranks run on one kernel and share its CPUs:
    # blocks are cut for all of them (two ranks on each of two "hosts": four local ranks).
    hosts = {r: {"DDL_HOST_ID": f"host{r // 2}"} for r in range(4)}
    res = run_ranks(
        _init_and_report,
        4,
        str(tmp_path / "claims"),
        rank_envs=hosts,
        env={"DDL_TRANSPORT": "tcp"},
    )
    assert [r[1] for r in res] == _expected(4), res


def _hold_a_pinned_job(rank, size, claims, started, finish):
    import ddlcore

    _claims_in(claims)
    with ddlcore.init():
        started.wait(60)
        finish.wait(60)
        return _cpus()


def test_a_second_job_is_left_to_the_kernel_beside_a_pinned_one(tmp_path):
    claims = str(tmp_path / "claims")
    started, finish = barrier(3), event()
    first = threading.Thread(
        target=lambda: out.append(run_ranks(_hold_a_pinned_job, 2, claims, started, finish))
    )
    out: list = []
    first.start()
    try:
        started.wait(60)
        second = run_ranks(_init_and_report, 2, claims)
    finally:
        finish.set()
        first.join(120)
    assert out and out[0] == _expected(2), out
    if out[0] != [_cpus()] * 2:  # the first job was pinned: the second runs where it may
        assert all(seen == _cpus() for r in second for seen in r), second
    # Once the first job is gone, its claims go with it.
    again = run_ranks(_init_and_report, 2, claims)
    assert [r[1] for r in again] == _expected(2), again
    assert not os.path.exists(claims)
