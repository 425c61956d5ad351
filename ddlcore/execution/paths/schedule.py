"""The schedule path: the tuner's algorithm as a schedule (``ddlcore.algorithms``) that the
``engine`` runs over the links, on host buffers. It takes every call the paths before it leave;
where this host has boards, the call is compared with the host's other ranks there first."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from ddlcore import topology
from ddlcore.algorithms import ALGORITHMS, Buf, Schedule, agreement
from ddlcore.calls import ROOTED, Call, prepare
from ddlcore.collectives import Collective
from ddlcore.errors import DDLError
from ddlcore.execution.paths.base import (
    Context,
    PathBase,
    Plan,
    board_mode,
    check_word,
    schedule_chunk,
)
from ddlcore.kernels.cpu import array_address
from ddlcore.ops import Op
from ddlcore.planning import tuning

NAME = "schedule"


def make_schedule(
    collective: Collective,
    choice: tuning.Choice,
    rank: int,
    size: int,
    count: int,
    itemsize: int,
    root: int,
    topo: topology.Topology,
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> Schedule:
    """``choice``'s schedule of ``collective`` for ``rank`` of ``size`` (``splits``:
    alltoallv's send and receive counts, this rank's)."""
    make = ALGORITHMS[collective][choice.algorithm]
    if collective == Collective.BARRIER:
        return make(rank, size)
    if collective in ROOTED or collective == Collective.BROADCAST:
        return make(rank, size, count, itemsize, choice.chunk_bytes, root)
    if collective == Collective.ALLTOALL:
        return make(rank, size, count, itemsize, choice.chunk_bytes)
    if collective == Collective.ALLTOALLV:
        assert splits is not None
        return make(rank, size, *splits, itemsize, choice.chunk_bytes)
    if choice.segments > 1:
        return make(
            rank,
            size,
            count,
            itemsize,
            choice.chunk_bytes,
            topo,
            dim_order=choice.dim_order,
            segments=choice.segments,
        )
    if choice.dim_order is not None:
        return make(
            rank, size, count, itemsize, choice.chunk_bytes, topo, dim_order=choice.dim_order
        )
    return make(rank, size, count, itemsize, choice.chunk_bytes, topo)


def schedules(
    ctx: Context, chunk_bytes: int | None = None
) -> functools._lru_cache_wrapper[tuple[tuning.Choice, Schedule]]:
    """``(collective, count, itemsize, root, splits=None) -> (choice, schedule)``, the recent
    kept: schedules are pure functions of the call's shape on a fixed topology. ``chunk_bytes``:
    the pipeline chunk (default: the context's)."""

    def build(
        collective: Collective,
        count: int,
        itemsize: int,
        root: int,
        splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
    ) -> tuple[tuning.Choice, Schedule]:
        choice = ctx.choose(collective, count * itemsize, chunk_bytes)
        return choice, agreement.agreed(
            lambda r: make_schedule(
                collective, choice, r, ctx.size, count, itemsize, root, ctx.topology, splits
            ),
            ctx.rank,
            ctx.size,
            agreement.natural_completeness(collective, count, ctx.size),
        )

    return functools.lru_cache(maxsize=256)(build)


@dataclass(frozen=True)
class NativePlan:
    """A call shape the compiled front end runs on the links (`SchedulePath.native_plan`): the
    tuner's choice and schedule, the check word, and the kernel codes of dtype, op and avg's
    divisor (0: none)."""

    planned: tuple[tuning.Choice, Schedule]
    check: int
    itemsize: int
    code: int
    op: int
    divisor: int


class SchedulePath(PathBase):
    """Every call, as a schedule over the links (host buffers)."""

    name = NAME

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.schedule = schedules(ctx)
        self.device_schedule = schedules(ctx, ctx.device_chunk_bytes or None)
        self._bufs = np.zeros(len(Buf), np.uint64)

    def plan(self, call: Call) -> Plan | None:
        itemsize = call.inp.dtype.itemsize if call.inp is not None else 1
        return Plan(itemsize, board_mode(self.ctx, call, itemsize))

    def _run(self, plan: Plan, call: Call, seq: int) -> None:
        def run(host_in: np.ndarray | None, host_out: np.ndarray | None) -> None:
            self.agree_first(plan, call, seq, host_in, host_out)
            on_device = schedule_chunk(self.ctx, call) != self.ctx.chunk_bytes
            planned = (self.device_schedule if on_device else self.schedule)(
                call.collective, call.count, plan.itemsize, call.root, call.splits
            )
            self.on_links(
                call,
                seq,
                planned,
                host_in,
                host_out,
                plan.itemsize,
            )

        self.in_host_memory(call, run)

    # --- for the compiled front end (``ddlcore.execution.frontend.OnLinks``) ---------------------
    def native_plan(self, call: Call) -> NativePlan | None:
        """How the front end runs ``call`` (host memory, this path's): as one native call of
        the links' runner (`Links.run_steps`), where one transport links every peer and no
        boards are involved, and the schedule is one stream without scratch; else None."""
        ctx = self.ctx
        links = ctx.links
        if links is None or links.run_steps is None or ctx.host is not None or ctx.node is not None:
            return None
        plan = self.plan(call)
        assert call.inp is not None and plan is not None
        if plan.mode is not None or schedule_chunk(ctx, call) != ctx.chunk_bytes:
            return None
        planned = self.schedule(call.collective, call.count, plan.itemsize, call.root, call.splits)
        choice, sched = planned
        if sched.parts or sched.scratch_count:
            return None
        op = call.op
        return NativePlan(
            planned,
            check_word(call, chunk_bytes=choice.chunk_bytes),
            plan.itemsize,
            int(call.inp.code),
            int(Op.SUM if op in (None, Op.AVG) else op),
            ctx.size if op == Op.AVG and ctx.size > 1 else 0,
        )

    def _native_bufs(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """The addresses of the buffers by `Buf` number, in an array kept for the purpose
        (calls run one at a time, under the executor's run lock)."""
        bufs = self._bufs
        bufs[0], bufs[1] = array_address(x), array_address(out)
        return bufs

    def run_native(
        self, plan: NativePlan, seq: int, x: np.ndarray, out: np.ndarray, op: Op
    ) -> None:
        """Call number ``seq``, an allreduce of ``x`` into ``out`` planned by `native_plan`: the
        links' runner first, then the engine from the step where it stopped, as `_run` would
        (the same messages, tags and check word)."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.timeout  # one for the whole call, as engine.run's
        self._busy, self._on_boards = True, False
        table = plan.planned[1].table
        isz = plan.itemsize
        slots = ctx.staging.ensure(ctx.depth, table.max_reduced * isz) if table.max_reduced else []
        assert ctx.links is not None
        run_steps, step, pending = ctx.links.run_steps, 0, None
        if run_steps is not None:
            try:
                step, pending = run_steps(
                    table.rows,
                    table.max_count,
                    (seq & 0x7FFFFFFF) << 32,  # the engine's tags: engine.Collective takes seq so
                    plan.check,
                    self._native_bufs(x, out),
                    slots[0].ptr if slots else 0,
                    isz,
                    plan.code,
                    plan.op,
                    plan.divisor,
                    ctx.timeout,
                    (x, out),
                )
            except DDLError:  # before anything was sent (a peer not reached): the engine names it
                step, pending = 0, None
        if step < len(table.rows) or pending is not None:
            call = prepare(Collective.ALLREDUCE, x, op, out, 0, ctx.size)
            left = max(0.0, deadline - time.monotonic())
            self.on_links(call, seq, plan.planned, x, out, isz, left, step, pending, False)
        self._busy = False

    def close(self) -> None:
        self.schedule.cache_clear()
        self.device_schedule.cache_clear()
