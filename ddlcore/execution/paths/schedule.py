"""The schedule path: the tuner's algorithm as a schedule (``ddlcore.algorithms``) that the
``engine`` runs over the links, on host buffers. It takes every call the paths before it leave;
where this host has boards, the call is compared with the host's other ranks there first."""

from __future__ import annotations

import functools

import numpy as np

from ddlcore.algorithms import ALGORITHMS, Schedule, agreement
from ddlcore.calls import ROOTED, Call
from ddlcore.collectives import Collective
from ddlcore.execution.paths.base import Context, PathBase, Plan, board_mode, schedule_chunk
from ddlcore.planning import topology, tuning

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


class SchedulePath(PathBase):
    """Every call, as a schedule over the links (host buffers)."""

    name = NAME

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.schedule = schedules(ctx)
        self.device_schedule = schedules(ctx, ctx.device_chunk_bytes or None)

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

    def close(self) -> None:
        self.schedule.cache_clear()
        self.device_schedule.cache_clear()
