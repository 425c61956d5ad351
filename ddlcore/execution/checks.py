"""The ranks compare a call before it runs: `agree`, over links whose messages carry no check
word (each rank's call against every other's, through `engine.agree`), and `compare_calls`,
DDL_DEBUG's full comparison (an allgather of every rank's kind, dtype, op, count and root)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddlcore import calls
from ddlcore.algorithms import ALGORITHMS, Buf
from ddlcore.calls import Call
from ddlcore.collectives import Collective
from ddlcore.errors import CollectiveMismatchError
from ddlcore.execution import engine
from ddlcore.execution.hostcoll import BoardKind
from ddlcore.execution.paths.base import check_word, label
from ddlcore.kernels.dtypes import dtype_name

_DEBUG_SEQ = 0x80000000  # tag space of DDL_DEBUG's signature exchange, apart from collectives


def agree(call: Call, seq: int, rank: int, size: int, links: Any, timeout: float) -> None:
    """Compare ``call`` with every rank's before it runs (`engine.agree`)."""
    engine.agree(
        rank,
        size,
        seq & 0x7FFFFFFF,
        check_word(call),
        calls.fingerprint(call),
        links,
        timeout,
        label(call, seq),
        calls.describe_fingerprint,
    )


def compare_calls(
    call: Call, seq: int, rank: int, size: int, links: Any, ctx: Any, timeout: float
) -> None:
    """DDL_DEBUG: allgather every rank's (kind, dtype, op, count, root) and compare."""
    name = label(call, seq)
    mine = np.array(
        [
            BoardKind.of(call.collective),
            call.inp.check_code if call.inp else -1,
            int(call.op) if call.op is not None else -1,
            call.count,
            call.root,
        ],
        np.int64,
    )
    every = np.empty(size * mine.size, np.int64)
    sched = ALGORITHMS[Collective.ALLGATHER]["ring"](rank, size, mine.size, 8, 1 << 20)
    coll = engine.Collective(
        (seq & 0x7FFFFFFF) | _DEBUG_SEQ, 0, 8, 7, None, f"{name} agreement check"
    )
    engine.run(
        sched,
        coll,
        {Buf.INPUT: engine.Region.of(mine), Buf.OUTPUT: engine.Region.of(every)},
        links,
        ctx.staging,
        ctx.depth,
        timeout,
    )
    rows = every.reshape(size, mine.size)
    if not (rows == mine).all():
        lines = [f"rank {r}: {_described(*row)}" for r, row in enumerate(rows.tolist())]
        raise CollectiveMismatchError(
            f"rank {rank}: {name}: ranks called different collectives "
            f"(DDL_DEBUG check):\n  " + "\n  ".join(lines)
        )


def _described(kind: int, code: int, op: int, count: int, root: int) -> str:
    """One row of `compare_calls` as messages name a call: "allreduce(1000 x float32, sum)"."""
    try:
        collective = Collective(BoardKind(kind).name.lower())
    except ValueError:
        return f"kind {kind}({count} x {dtype_name(code)}, {calls.op_name(op)}, root {root})"
    return calls.describe_call(collective, code, op, root, count)
