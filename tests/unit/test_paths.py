"""The execution paths without a job: which path takes a call (the first whose ``plan`` accepts
it, in the communicator's order), and whom a path tells after a failure (the peers its failing
step did not reach: the links after a board step, the boards after a links step)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ddlcore import calls, topology
from ddlcore.buffers import MemoryKind
from ddlcore.collectives import Collective
from ddlcore.errors import DDLError, PeerFailureError
from ddlcore.execution import hostcoll, paths
from ddlcore.execution.paths.base import ON_BOARDS


class FakeBoards:
    """`HostCollectives` as the paths see it: its mode by size, its calls, its abort notes."""

    def __init__(self, size: int, direct: bool = True, fail: bool = False) -> None:
        self.rank, self.size, self.direct, self.fail = 0, size, direct, fail
        self.calls: list[hostcoll.BoardCall] = []
        self.aborts: list[tuple[int, str]] = []

    def mode(self, in_bytes: int) -> int:
        if in_bytes <= hostcoll.SMALL_MAX:
            return hostcoll.SLOTS
        return hostcoll.DIRECT if self.direct else hostcoll.SYNC_ONLY

    def run(self, call: hostcoll.BoardCall) -> None:
        self.calls.append(call)
        if self.fail:
            raise PeerFailureError(f"rank 0: {call.label()} via direct: rank 1 exited", 1)

    def abort(self, code: int, reason: str) -> None:
        self.aborts.append((code, reason))


class FakeLinks:
    """`Links` whose peer connections are gone (``pair`` fails), recording abort notes."""

    def __init__(self) -> None:
        self.aborts: list[tuple[int, str]] = []

    def pair(self, peer: int) -> None:
        raise PeerFailureError(f"rank 0: the connection to rank {peer} is gone", peer)

    def abort(self, code: int, reason: str) -> None:
        self.aborts.append((code, reason))


def _context(hosts: str, *, host=None, node=None, links=None, algo="auto") -> paths.Context:
    topo = topology.build(list(hosts), [""] * len(hosts), {"host": "shm", "network": "tcp"}, {})
    return paths.Context(
        0,
        len(hosts),
        topo,
        links,
        30.0,
        depth=4,
        debug=False,
        algo=algo,
        chunk_bytes=1 << 20,
        segments=0,
        host=host,
        node=node,
    )


def _walk(ctx: paths.Context, call: calls.Call) -> tuple[str, paths.Plan]:
    for make in paths.PATHS:
        path = make(ctx)
        plan = path.plan(call)
        if plan is not None:
            return path.name, plan
    raise AssertionError("no path took the call")  # the schedule path takes every call


def _call(collective: Collective, count: int, size: int) -> calls.Call:
    if collective == Collective.BARRIER:
        return calls.prepare(collective, None, None, None, 0, size)
    op = "sum" if collective in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER) else None
    return calls.prepare(
        collective,
        np.ones(count * size, np.float32)[
            : count * size if collective == Collective.REDUCE_SCATTER else count
        ],
        op,
        None,
        0,
        size,
    )


def _on_device(call: calls.Call) -> calls.Call:
    """The call as if its buffers were device memory (only the descriptors' kind changes)."""
    assert call.inp is not None
    inp = dataclasses.replace(call.inp, memory=MemoryKind.CUDA)
    return dataclasses.replace(call, inp=inp, out=inp)


def test_the_order_is_boards_host_staged_device_schedule():
    assert [p.name for p in paths.PATHS] == ["boards", "host-staged", "device", "schedule"]


@pytest.mark.parametrize("collective", ON_BOARDS)
def test_one_host_runs_on_the_boards_where_they_take_the_call(collective):
    small = _call(collective, 1000, 2)
    large = _call(collective, 1 << 20, 2)
    direct = _context("aa", host=FakeBoards(2))
    assert _walk(direct, small) == ("boards", paths.Plan(4 if small.inp else 1, hostcoll.SLOTS))
    if collective != Collective.BARRIER:
        assert _walk(direct, large) == ("boards", paths.Plan(4, hostcoll.DIRECT))
        # too large for the slots, no direct reads: a schedule, after a sync point on the boards
        assert _walk(_context("aa", host=FakeBoards(2, direct=False)), large) == (
            "schedule",
            paths.Plan(4, hostcoll.SYNC_ONLY),
        )
        assert _walk(_context("aa", host=FakeBoards(2, direct=False)), _on_device(large)) == (
            "device",
            paths.Plan(4, hostcoll.SYNC_ONLY),
        )
        # device buffers the boards take are staged through host memory, on the boards
        assert _walk(direct, _on_device(large))[0] == "boards"


@pytest.mark.parametrize("collective", [c for c in Collective if c not in ON_BOARDS])
def test_the_boards_only_compare_the_collectives_they_do_not_run(collective):
    """Reduce, gather, scatter, alltoall(v): schedules after a sync point on the boards (device
    buffers on the device path: more than one chunk of them)."""
    n = 1 << 18  # 1 MiB of float32 per block: the 2 MiB call spans two of the context's chunks
    x = np.ones(n * 2, np.float32)
    splits = ((n, n), (n, n)) if collective == Collective.ALLTOALLV else None
    call = calls.prepare(collective, x, None, None, 0, 2, 0, splits)
    ctx = _context("aa", host=FakeBoards(2))
    assert _walk(ctx, call) == ("schedule", paths.Plan(4, hostcoll.SYNC_ONLY))
    assert _walk(ctx, _on_device(call)) == ("device", paths.Plan(4, hostcoll.SYNC_ONLY))


def test_without_boards_calls_run_as_schedules_or_on_the_device():
    ctx = _context("ab")
    call = _call(Collective.ALLREDUCE, 1 << 20, 2)
    assert _walk(ctx, call) == ("schedule", paths.Plan(4))
    assert _walk(ctx, _on_device(call)) == ("device", paths.Plan(4))


def test_host_staged_takes_what_the_tuner_runs_as_mdring_host_first():
    ctx = _context("aabb", node=FakeBoards(2), algo="mdring")
    staged = paths.HostStagedPath(ctx)
    taken = []
    for collective in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER):
        for count in (4, 1 << 16, 1 << 22):
            call = _call(collective, count, 4)
            name, plan = _walk(ctx, call)
            choice = staged.choice(collective, call.count * 4)
            assert (name == "host-staged") == (choice is not None), (collective, count)
            if choice is not None:
                assert plan.choice == choice and choice.host_path == hostcoll.NAME
                assert choice.algorithm == "mdring"
                taken.append(collective)
    assert set(taken) == {Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER}
    # broadcast and barrier never take it; device buffers do (staged through host memory)
    assert _walk(ctx, _call(Collective.BROADCAST, 1 << 22, 4))[0] == "schedule"
    assert _walk(ctx, _on_device(_call(Collective.ALLREDUCE, 1 << 22, 4)))[0] == "host-staged"


def test_a_failed_board_step_tells_the_links_and_a_failed_links_step_the_boards():
    links, boards = FakeLinks(), FakeBoards(2, fail=True)
    ctx = _context("aa", host=boards, links=links)
    path = paths.BoardsPath(ctx)
    idle = paths.SchedulePath(ctx)
    call = _call(Collective.ALLREDUCE, 10, 2)
    plan = path.plan(call)
    assert plan is not None
    with pytest.raises(PeerFailureError):
        path.run(plan, call, 7)
    assert boards.calls[0].kind == hostcoll.BoardKind.ALLREDUCE and boards.calls[0].count == 10
    assert "allreduce #7 (10 x float32, sum)" in boards.calls[0].label()
    for each in (path, idle):  # what the communicator does: every path, once
        each.abort(3, "rank 1 exited")
    assert links.aborts == [(3, "rank 1 exited")] and boards.aborts == []

    # a schedule path whose call fails on the links, after a sync point on the boards
    boards = FakeBoards(2, direct=False)
    ctx = _context("aa", host=boards, links=FakeLinks())
    path = paths.SchedulePath(ctx)
    call = _call(Collective.ALLREDUCE, 1 << 20, 2)
    plan = path.plan(call)
    assert plan == paths.Plan(4, hostcoll.SYNC_ONLY)
    with pytest.raises(DDLError, match="rank 1"):
        path.run(plan, call, 8)
    assert [c.mode for c in boards.calls] == [hostcoll.SYNC_ONLY]  # compared first
    path.abort(5, "why")
    assert boards.aborts == [(5, "why")]


def test_board_kinds_name_the_allreduce_halves():
    kinds = hostcoll.BoardKind
    assert kinds.of("allgather") is kinds.ALLGATHER and kinds.of(Collective.BARRIER) == 5
    assert kinds.HOST_REDUCE_SCATTER.label == "allreduce, host reduce-scatter"
    assert kinds.HOST_ALLGATHER.phase == "host allgather" and kinds.BROADCAST.phase is None
    assert kinds.REDUCE_SCATTER.label == "reduce_scatter"


def test_collective_reads_as_its_name():
    import json
    import logging

    c = Collective.REDUCE_SCATTER
    assert c == "reduce_scatter" and {"reduce_scatter": 1}[c] == 1
    assert f"{c}" == str(c) == f"{c:>14}" == "reduce_scatter"
    assert logging.makeLogRecord({"msg": "%s", "args": (c,)}).getMessage() == "reduce_scatter"
    assert json.dumps({"collective": c}) == '{"collective": "reduce_scatter"}'
    assert calls.prepare("barrier", None, None, None, 0, 2).collective is Collective.BARRIER


def test_check_word_is_the_crc32_of_the_packed_call():
    """One native function computes the word for both front ends: zlib's CRC-32 of the call
    packed as ``<BBBqqq`` (kind, dtype, op, count, root, chunk bytes), made odd."""
    import struct
    import zlib

    from ddlcore.execution.frontend import check_word

    rng = np.random.default_rng(5)
    cases = [(5, 255, 255, 0, 0, 0), (1, 2, 0, 1, -3, 1 << 20), (255, 0, 4, -(2**63), 2**63 - 1, 0)]
    for _ in range(500):
        small = rng.integers(0, 256, 3)
        big = rng.integers(-(2**63), 2**63 - 1, 3, dtype=np.int64)
        cases.append((*map(int, small), *map(int, big)))
    for case in cases:
        assert check_word(*case) == zlib.crc32(struct.pack("<BBBqqq", *case)) | 1, case
