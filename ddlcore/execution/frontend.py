"""A one-host communicator's compiled front end (``_frontend.FrontEnd``: checked arguments,
sequence number, flight record and the boards' native call in one step), built from the
communicator's parts. The Python path stays the reference: the front end declines whatever it
does not handle, before anything is taken or sent."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ddlcore.buffers import MemoryKind
from ddlcore.collectives import Collective
from ddlcore.execution._frontend import DECLINED, FrontEnd, check_word
from ddlcore.execution.hostcoll import BoardKind, HostCollectives
from ddlcore.kernels.dtypes import DType, numpy_dtype
from ddlcore.ops import Op
from ddlcore.trace.flight import FlightRecorder

__all__ = ["DECLINED", "FrontEnd", "build", "check_word"]

# The board kinds the front end runs, as the collectives they are.
KINDS = {
    BoardKind.ALLREDUCE: Collective.ALLREDUCE,
    BoardKind.BROADCAST: Collective.BROADCAST,
    BoardKind.BARRIER: Collective.BARRIER,
}


def build(
    host: HostCollectives | None,
    executor: Any,
    recorder: FlightRecorder,
    failed: Callable[..., BaseException],
    broken: Callable[[BaseException, int], None],
) -> FrontEnd | None:
    """The front end of a communicator whose ranks all share this host (``host``: its
    connected boards), or None without boards."""
    if host is None or host.arena is None:
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
    )
