"""A communicator's compiled front end (``_frontend.FrontEnd``: checked arguments, sequence
number, flight record and, on one host, the boards' native call in one step; on the links, the
links' native runner through `OnLinks`), built from the communicator's parts. The Python path stays the reference: the front end declines whatever it
does not handle, before anything is taken or sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ddlcore.buffers import MemoryKind
from ddlcore.calls import prepare
from ddlcore.collectives import Collective
from ddlcore.execution._frontend import DECLINED, FrontEnd, check_word
from ddlcore.execution.hostcoll import BoardKind, HostCollectives
from ddlcore.execution.paths import Path
from ddlcore.execution.paths.schedule import NativePlan, SchedulePath
from ddlcore.flight import FlightRecorder
from ddlcore.kernels.dtypes import DType, numpy_dtype
from ddlcore.ops import Op

__all__ = ["DECLINED", "FrontEnd", "OnLinks", "build", "check_word"]

# The board kinds the front end runs, as the collectives they are.
KINDS = {
    BoardKind.ALLREDUCE: Collective.ALLREDUCE,
    BoardKind.BROADCAST: Collective.BROADCAST,
    BoardKind.BARRIER: Collective.BARRIER,
}


class OnLinks:
    """The front end's Python half for allreduces on the links: which shapes it takes (those
    the Python path runs as a schedule the links' native runner takes whole: `plan`, once per
    shape) and running one (`run`); a failure breaks the communicator as the Python path's
    does (``fail(error, slot)``, which raises)."""

    def __init__(
        self,
        size: int,
        paths: tuple[Path, ...],
        schedule_path: SchedulePath,
        fail: Callable[[BaseException, int], None],
    ) -> None:
        self.size, self.paths, self.schedule_path, self.fail = size, paths, schedule_path, fail

    def plan(self, x: np.ndarray, out: np.ndarray, op: Op) -> NativePlan | None:
        """The plan of an allreduce shaped as ``x`` into ``out`` with ``op`` (kept by the
        front end for every call of that count, dtype and op), if the path the Python path
        would take is the schedule path and it runs natively; None (declined) otherwise, or
        if planning fails (the Python path then runs the call, and names what is wrong)."""
        try:
            call = prepare(Collective.ALLREDUCE, x, op, out, 0, self.size)
            taker = next((p for p in self.paths if p.plan(call) is not None), None)
            return self.schedule_path.native_plan(call) if taker is self.schedule_path else None
        except Exception:
            return None

    def run(
        self, plan: NativePlan, seq: int, slot: int, x: np.ndarray, out: np.ndarray, op: Op
    ) -> None:
        try:
            self.schedule_path.run_native(plan, seq, x, out, op)
        except BaseException as exc:
            self.fail(exc, slot)  # raises


def build(
    host: HostCollectives | None,
    executor: Any,
    recorder: FlightRecorder,
    failed: Callable[..., BaseException],
    broken: Callable[[BaseException, int], None],
    links: OnLinks | None = None,
) -> FrontEnd | None:
    """The front end of a communicator whose ranks all share this host (``host``: its
    connected boards), or of one whose allreduces can run on the links' native runner
    (``links``); None for others."""
    if host is not None and host.arena is None:
        return None
    if host is None and links is None:
        return None
    calls, ends = recorder.slots() or (None, None)
    return FrontEnd(
        host,
        executor,
        calls,
        ends,
        tuple(numpy_dtype(code) for code in DType),
        ({op.name.lower(): op for op in Op}, Op),
        (Collective.ALLREDUCE, Collective.BROADCAST, Collective.BARRIER, MemoryKind.HOST),
        failed,
        broken,
        links,
    )
