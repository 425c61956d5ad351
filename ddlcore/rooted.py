"""The rooted collectives and alltoall(v) of `ddlcore.Communicator` (a base class of it, kept
apart to keep the communicator's file small): reduce, gather, scatter, alltoall and alltoallv,
and their ``_async`` variants. They check and describe their calls (``calls.prepare``) and run
them as every other collective runs, as schedules (``algorithms.rooted``, ``algorithms.alltoall``)
on any transport and on device buffers; the boards only compare them at a sync point."""

from __future__ import annotations

from typing import Any

import numpy as np

from ddlcore import calls
from ddlcore.calls import Call
from ddlcore.collectives import Collective
from ddlcore.handles import Handle
from ddlcore.ops import Op


class RootedCollectives:
    """Reduce, gather, scatter, alltoall and alltoallv over `_run` (blocking) and `_submit`
    (a `Handle`), the `Communicator`'s."""

    rank: int
    size: int

    def _run(self, call: Call) -> Any:
        raise NotImplementedError

    def _submit(self, call: Call) -> Handle:
        raise NotImplementedError

    def reduce(self, x: Any, op: str | Op = "sum", root: int = 0, out: Any = None) -> Any:
        """Reduce ``x`` element-wise over all ranks into ``root``'s result.

        The result equals `allreduce`'s under ``DDL_ALGO=ring`` bit for bit (the same ring
        reduce-scatter; ``algorithms.rooted``), so it may differ from an allreduce the tuner
        ran otherwise by rounding only; an integer avg runs as allreduce's exact one.

        Returns
        -------
        array or None
            On ``root``: ``out`` if given, else a new array shaped like ``x``. Elsewhere None
            (an ``out`` given there is checked but left untouched).
        """
        return self._run(self._prepare(Collective.REDUCE, x, op, out, root))

    def reduce_async(self, x: Any, op: str | Op = "sum", root: int = 0, out: Any = None) -> Handle:
        return self._submit(self._prepare(Collective.REDUCE, x, op, out, root))

    def gather(self, x: Any, root: int = 0, out: Any = None) -> Any:
        """Concatenate every rank's ``x`` (k elements each) on ``root``, as `allgather` does:
        ``root`` gets size * k elements (rank r's at r * k, along the first dimension); the
        others get None."""
        return self._run(self._prepare(Collective.GATHER, x, None, out, root))

    def gather_async(self, x: Any, root: int = 0, out: Any = None) -> Handle:
        return self._submit(self._prepare(Collective.GATHER, x, None, out, root))

    def scatter(self, x: Any, root: int = 0, out: Any = None) -> Any:
        """Send block r of ``root``'s ``x`` (size * k elements) to rank r.

        ``x`` is read on ``root`` only. Elsewhere pass either ``x`` shaped like the root's
        (only its shape and dtype are used) or ``x=None`` and ``out=`` (k elements: the
        destination, as mpi4py's ``Scatter`` and torch's ``scatter`` take it). The result is
        shaped as `reduce_scatter`'s: ``(shape[0] // size, *shape[1:])`` where the first
        dimension divides by size, else 1-D; ``out`` if given.
        """
        return self._run(self._prepare(Collective.SCATTER, x, None, out, root))

    def scatter_async(self, x: Any, root: int = 0, out: Any = None) -> Handle:
        return self._submit(self._prepare(Collective.SCATTER, x, None, out, root))

    def alltoall(self, x: Any, out: Any = None) -> Any:
        """Send block j of ``x`` (size * k elements, k per block) to rank j; block i of the
        result (shaped like ``x``) came from rank i."""
        return self._run(self._prepare(Collective.ALLTOALL, x, None, out, 0))

    def alltoall_async(self, x: Any, out: Any = None) -> Handle:
        return self._submit(self._prepare(Collective.ALLTOALL, x, None, out, 0))

    def alltoallv(self, x: Any, send_counts: Any, recv_counts: Any = None, out: Any = None) -> Any:
        """Send ``send_counts[j]`` elements of ``x`` (packed in rank order) to rank j; the
        result (1-D, ``sum(recv_counts)`` elements) holds ``recv_counts[i]`` from rank i, in
        rank order. Without ``recv_counts`` the ranks first exchange their counts (an
        `alltoall` of one int64 per rank)."""
        return self._run(self._prepare_v(x, send_counts, recv_counts, out))

    def alltoallv_async(
        self, x: Any, send_counts: Any, recv_counts: Any = None, out: Any = None
    ) -> Handle:
        """`alltoallv` in the background (the counts' exchange, if any, first, blocking)."""
        return self._submit(self._prepare_v(x, send_counts, recv_counts, out))

    def _prepare(self, collective: Collective, x: Any, op: Any, out: Any, root: int) -> Call:
        return calls.prepare(collective, x, op, out, root, self.size, self.rank)

    def _prepare_v(self, x: Any, send_counts: Any, recv_counts: Any, out: Any) -> Call:
        send = calls.check_splits(send_counts, self.size, "send_counts")
        if recv_counts is None:
            recv_counts = self.alltoall(np.asarray(send, np.int64)).tolist()
        recv = calls.check_splits(recv_counts, self.size, "recv_counts")
        if send[self.rank] != recv[self.rank]:
            raise ValueError(
                f"rank {self.rank}: send_counts[{self.rank}]={send[self.rank]} but "
                f"recv_counts[{self.rank}]={recv[self.rank]}: what a rank sends itself it receives"
            )
        return calls.prepare(
            Collective.ALLTOALLV, x, None, out, 0, self.size, self.rank, (send, recv)
        )
