"""The boards path: where every rank of the communicator is on this host, a call the boards'
slots hold, or any call where direct reads are on, runs as one native call through the shared
boards (``hostcoll``); device buffers are staged whole through pinned host memory."""

from __future__ import annotations

import numpy as np

from ddlcore.calls import Call
from ddlcore.execution import hostcoll
from ddlcore.execution.paths.base import ON_BOARDS, PathBase, Plan
from ddlcore.ops import Op

NAME = "boards"


class BoardsPath(PathBase):
    """Calls of a one-host communicator through its boards (``host``)."""

    name = NAME

    def plan(self, call: Call) -> Plan | None:
        host = self.ctx.host
        if host is None or call.collective not in ON_BOARDS:
            return None
        itemsize = call.inp.dtype.itemsize if call.inp is not None else 1
        mode = host.mode(call.count * itemsize)
        return None if mode == hostcoll.SYNC_ONLY else Plan(itemsize, mode)

    def _run(self, plan: Plan, call: Call, seq: int) -> None:
        host, mode = self.ctx.host, plan.mode
        assert host is not None and mode is not None
        divisor = self.ctx.size if call.op == Op.AVG else 0

        def run(host_in: np.ndarray | None, host_out: np.ndarray | None) -> None:
            self.on_boards(host, call, seq, host_in, host_out, plan.itemsize, mode, divisor=divisor)

        self.in_host_memory(call, run)
