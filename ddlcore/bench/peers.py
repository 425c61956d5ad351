"""ddl-bench's peers (``--compare mpi,gloo``): MPI_Allreduce and friends through mpi4py, and
torch.distributed's gloo backend, timed in the same processes on the same `Case` buffers as
ddlcore. Each peer says which cases it supports and gives the collective as one callable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from ddlcore.collectives import Collective

if TYPE_CHECKING:
    from ddlcore.bench.cases import Case

PEERS = ("mpi", "gloo")


class _MpiPeer:
    name = "mpi"

    def __init__(self, comm) -> None:
        try:
            from mpi4py import MPI
        except ImportError:
            raise SystemExit(
                "ddl-bench: --compare mpi needs mpi4py (pip install 'ddlcore[mpi]')"
            ) from None
        self.MPI, self.world = MPI, MPI.COMM_WORLD
        if self.world.Get_size() != comm.size:
            raise SystemExit(
                f"ddl-bench: --compare mpi needs the job started by mpiexec "
                f"(MPI sees {self.world.Get_size()} ranks, ddlcore {comm.size}); "
                f"run: mpiexec -n {comm.size} ddl-bench ..."
            )
        self._ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def supports(self, case: Case) -> bool:
        return case.op in self._ops and case.x.dtype.kind != "V" and case.x.dtype != np.float16

    def op(self, case: Case) -> Callable[[], None]:
        w, c = self.world, case.collective
        if c == Collective.ALLREDUCE:
            return lambda: w.Allreduce(case.x, case.out, op=self._ops[case.op])
        if c == Collective.REDUCE_SCATTER:
            return lambda: w.Reduce_scatter_block(case.x, case.out, op=self._ops[case.op])
        if c == Collective.ALLGATHER:
            return lambda: w.Allgather(case.x, case.out)
        if c == Collective.REDUCE:
            return lambda: w.Reduce(case.x, case.out, op=self._ops[case.op], root=case.root)
        if c == Collective.GATHER:
            return lambda: w.Gather(case.x, case.out, root=case.root)
        if c == Collective.SCATTER:
            return lambda: w.Scatter(case.x, case.out, root=case.root)
        if c == Collective.ALLTOALL:
            return lambda: w.Alltoall(case.x, case.out)
        return lambda: w.Bcast(case.out, root=case.root)


class _GlooPeer:
    name = "gloo"

    def __init__(self, comm) -> None:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            raise SystemExit(
                "ddl-bench: --compare gloo needs torch (pip install 'ddlcore[torch]')"
            ) from None
        self.torch, self.dist = torch, dist
        import socket

        port = np.zeros(1, np.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1" if comm.nhosts == 1 else "", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, root=0)
        addr = _master_addr()
        dist.init_process_group(
            "gloo", init_method=f"tcp://{addr}:{int(port[0])}", rank=comm.rank, world_size=comm.size
        )
        self._ops = {
            "sum": dist.ReduceOp.SUM,
            "prod": dist.ReduceOp.PRODUCT,
            "min": dist.ReduceOp.MIN,
            "max": dist.ReduceOp.MAX,
        }

    def supports(self, case: Case) -> bool:
        return (
            case.op in self._ops
            and case.x.dtype.kind != "V"
            and case.collective not in (Collective.GATHER, Collective.SCATTER)
        )

    def op(self, case: Case) -> Callable[[], None]:
        t, dist, c = self.torch, self.dist, case.collective
        x, out = t.from_numpy(case.x), t.from_numpy(case.out)
        if c == Collective.ALLREDUCE:

            def run() -> None:
                out.copy_(x)
                dist.all_reduce(out, op=self._ops[case.op])

            return run
        if c == Collective.REDUCE_SCATTER:
            return lambda: dist.reduce_scatter_tensor(out, x, op=self._ops[case.op])
        if c == Collective.ALLGATHER:
            return lambda: dist.all_gather_into_tensor(out, x)
        if c == Collective.REDUCE:

            def run_reduce() -> None:
                out.copy_(x)
                dist.reduce(out, dst=case.root, op=self._ops[case.op])

            return run_reduce
        if c == Collective.ALLTOALL:
            return lambda: dist.all_to_all_single(out, x)
        return lambda: dist.broadcast(out, src=case.root)

    def close(self) -> None:
        self.dist.destroy_process_group()


def _master_addr() -> str:
    from ddlcore.job.rendezvous import detect

    info = detect()
    return info.master_addr or "127.0.0.1"
