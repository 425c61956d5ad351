"""The silent wrong results of issue 19, as an attacker (or a buggy training script) would meet
them: a broadcast whose ranks name different roots, and 3-rank allreduces that differ in count,
dtype, op or kind. Each must fail with CollectiveMismatchError on every rank, within the
timeout, naming both calls, never complete with the ranks holding different data
(`ddlcore.algorithms.agreement`; the full matrix is ``tests/collectives/test_mismatch.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.collectives.test_mismatch import TIMEOUT_S, _check, _mismatch_cases
from tests.harness import run_ranks


def _two_roots(rank, size):
    """Rank r broadcasts with root r: before, every rank kept its own data and returned."""
    import ddlcore

    with ddlcore.init() as comm:
        x = np.full(1000, rank + 1, np.float32)
        try:
            comm.broadcast(x, root=rank)
        except ddlcore.CollectiveMismatchError as exc:
            return str(exc)
        return f"no error; rank {rank} holds {x[0]}"


@pytest.mark.parametrize("transport,algo", [("tcp", "auto"), ("shm", "ring"), ("shm", "auto")])
def test_broadcast_with_two_roots(transport, algo):
    env = {"DDL_TRANSPORT": transport, "DDL_ALGO": algo, "DDL_TIMEOUT": str(TIMEOUT_S)}
    for rank, got in enumerate(run_ranks(_two_roots, 2, env=env, timeout=120)):
        assert not got.startswith("no error"), got
        assert f"rank {rank}" in got and "broadcast #" in got, got
        assert "root 0" in got and "root 1" in got, got  # both calls, by name


# Each differs on one rank of three: count, an empty call, dtype, op, root, kind.
ALLREDUCES = [
    "count",
    "count 0",
    "count 1",
    "dtype",
    "op",
    "allreduce vs allgather",
    "allreduce vs broadcast",
    "allreduce vs barrier",
    "broadcast root",
]


@pytest.mark.parametrize("algo", ["auto", "ring"])
def test_mismatched_calls_at_three_ranks_over_tcp(algo):
    env = {"DDL_TRANSPORT": "tcp", "DDL_ALGO": algo, "DDL_TIMEOUT": str(TIMEOUT_S)}
    _check(run_ranks(_mismatch_cases, 3, ALLREDUCES, env=env, timeout=240), ALLREDUCES)
