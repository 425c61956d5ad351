"""The torch.distributed backend "ddl": ``dist.init_process_group("ddl")`` runs on ddlcore.

Importing ``ddlcore.integrations.torch`` registers it, and so does torch itself, through the
``torch.backends`` entry point it loads at the end of ``import torch`` (`autoload`): a script
need not import ddlcore. torch calls `_create` with its store, rank, size and timeout; ddlcore
meets the other ranks through that store (``ddlcore.init(store=...)``), under any launcher;
under mpiexec and srun torch's default rendezvous learns rank, size and its store's address
from ddlcore (`launchers`).

`ProcessGroupDDL` maps torch's collectives onto the `Communicator`: allreduce (SUM, AVG,
PRODUCT, MIN, MAX), allreduce_coalesced, allgather (lists and into one tensor, coalesced too),
reduce_scatter (likewise), broadcast, reduce, gather and scatter from any root, all_to_all and
all_to_all_single (split sizes too), barrier, send/recv (from any rank too; and
batch_isend_irecv), and groups over some of the ranks (a `Communicator.split` child). Each
returns an asynchronous `WorkDDL` whose ``wait()`` blocks without the GIL and whose
``get_future()`` completes with the output tensors; an allreduce or broadcast that torch waits
for at once on host memory runs there and then and returns none (see `_waited_host_view`).
"""

# torch's stubs overload some ProcessGroup methods and name arguments differently; the C++
# trampoline calls these by position, as the overrides below take them.
# mypy: disable-error-code="override,assignment"
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddlcore.integrations.torch import launchers
from ddlcore.integrations.torch.rooted import RootedCollectives
from ddlcore.integrations.torch.work import (
    WorkDDL,
    _all_data,
    _contiguous,
    _copier,
    _data,
    _dist_error,
    _op,
    _seconds,
)

BACKEND_NAME = "ddl"
_DEVICES = ["cpu", "cuda"]
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
# CPU tensors NumPy views as one of ddlcore's dtypes (bfloat16 it cannot).
_NUMPY_VIEWABLE = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
        torch.bool,
    }
)


def _waited_host_view(tensors: Sequence[torch.Tensor], opts: Any) -> Any:
    """The call's one tensor as a NumPy array where torch waits for the call at once
    (``async_op=False``) and the tensor is a contiguous CPU tensor NumPy can view; else None.

    Such a call runs as the communicator's synchronous one (on one host, its compiled front
    end) and returns no work: torch's ``dist.*`` functions wait on none when the backend
    already synchronized (as its C++ backends may). Every call into torch's pybind11 objects
    counts on this path: right after a collective that swept the caches one costs 5-40 us
    (np = 2, 1-16 MB), and a work is two of them (made and freed).

    Only torch's Python ``dist.*`` functions set ``asyncOp`` False (torch 2.13; every C++
    options struct defaults it to True): C++ callers, which would need a work, never get
    None. A torch whose options lack ``asyncOp`` takes the general path."""
    if opts is None or getattr(opts, "asyncOp", True) or len(tensors) != 1:
        return None
    t = tensors[0]
    if (
        type(t) not in _PLAIN_TENSORS  # not FakeTensor and other subclasses .numpy() refuses
        or not t.is_cpu
        or t.requires_grad  # .numpy() refuses it; the general path detaches
        or t.dtype not in _NUMPY_VIEWABLE
        or not t.is_contiguous()
        or t.is_neg()  # a lazily negated view: .numpy() refuses it
    ):
        return None
    return t.numpy()


def register() -> None:
    """Register the backend "ddl" with torch.distributed, and the rendezvous that lets
    ``init_process_group`` run under mpiexec and srun as written (`launchers`); again: no
    effect."""
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=list(_DEVICES)
        )
    launchers.install()


class ProcessGroupDDL(RootedCollectives, dist.ProcessGroup):  # type: ignore[misc]  # stubs
    """A torch.distributed process group whose collectives a ddlcore `Communicator` runs."""

    def __init__(self, comm: Any, rank: int, size: int, timeout: float) -> None:
        # The one constructor a Python subclass may call (the stub knows only the other).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._comm = comm
        self._timeout = timeout
        self._group_name = ""
        self._group_desc = ""

    # --- what torch asks of every process group -------------------------------------------
    def getBackendName(self) -> str:  # noqa: N802  (torch's C++ names)
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    @property
    def _device_types(self) -> list[torch.device]:
        devices = [torch.device("cpu")]
        if torch.cuda.is_available():
            devices.append(torch.device("cuda"))
        return devices

    @property
    def communicator(self) -> Any:
        """The ddlcore `Communicator` under this group."""
        return self._comm

    def shutdown(self) -> None:
        self._comm.close()

    def abort(self) -> None:
        self._comm.close()

    def __repr__(self) -> str:
        return f"ProcessGroupDDL(rank={self.rank()}, size={self.size()}, {self._comm!r})"

    # --- helpers ----------------------------------------------------------------------------
    def _work(self, what: str, outputs: list[torch.Tensor]) -> WorkDDL:
        # Every collective queued before this one may take the whole timeout too.
        return WorkDDL(what, outputs, self._comm.wait_budget())

    def _run(
        self,
        what: str,
        outputs: list[torch.Tensor],
        start: Callable[[], tuple[list[Any], Callable[[], None] | None]],
        opts: Any = None,
    ) -> WorkDDL:
        """Start a collective (``start`` returns its handles and finishing step). When torch
        waits for it at once (``opts.asyncOp`` False: ``async_op=False``), it runs here, on
        the calling thread, and the work returned is complete."""
        work = self._work(what, outputs)
        try:
            waited_at_once = not getattr(opts, "asyncOp", True)
            with self._comm.hold_worker() if waited_at_once else contextlib.nullcontext():
                handles, finish = start()
        except BaseException as exc:
            raise _dist_error(exc, what) from None
        return work._start(handles, finish)

    def _now(self, what: str, call: Callable[[], Any]) -> None:
        """Run ``call``, a synchronous collective on a `_waited_host_view`, with torch's error
        type for its failures."""
        try:
            call()
        except BaseException as exc:
            raise _dist_error(exc, what)  # noqa: B904  (its cause is set: ddlcore's error)

    def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor:
        """The one tensor of a call, detached (see `_data`)."""
        if len(tensors) != 1:
            raise ValueError(
                f"ddl backend, {what}: one tensor per call (one device per "
                f"process), got {len(tensors)}"
            )
        one = tensors[0]
        return _all_data(one) if isinstance(one, list) else _data(one)  # type: ignore[return-value]

    def _in_place(
        self, what: str, t: torch.Tensor, run: Callable[[torch.Tensor], Any], opts: Any
    ) -> WorkDDL:
        """Run ``run(buffer)`` on ``t``'s data (a contiguous copy when ``t`` is not)."""

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            buf = _contiguous(t)
            return [run(buf)], _copier([] if buf is t else [(t, buf)])

        return self._run(what, [t], start, opts)

    # --- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> WorkDDL | None:
        view = _waited_host_view(tensors, opts)
        if view is not None:
            op = _op(opts, "allreduce")
            self._now("allreduce", lambda: self._comm.allreduce(view, op=op, out=view))
            return None
        t = self._one(tensors, "allreduce")
        opts = opts or dist.AllreduceOptions()
        op = _op(opts, "allreduce")
        return self._in_place(
            "allreduce", t, lambda buf: self._comm.allreduce_async(buf, op=op, out=buf), opts
        )

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> WorkDDL:
        """One allreduce per dtype and device: the tensors packed into one flat buffer."""
        from ddlcore.integrations.torch._common import pack_into, unpack_from

        opts = opts or dist.AllreduceCoalescedOptions()
        op = _op(opts, "allreduce_coalesced")
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        tensors = _all_data(tensors)
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            handles, flats = [], []
            for (dtype, device), members in groups.items():
                flat = torch.empty(sum(t.numel() for t in members), dtype=dtype, device=device)
                pack_into(flat, members)
                flats.append((flat, members))
                handles.append(self._comm.allreduce_async(flat, op=op, out=flat))

            def finish() -> None:
                for flat, members in flats:
                    unpack_from(flat, members)

            return handles, finish

        return self._run("allreduce_coalesced", list(tensors), start, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> WorkDDL | None:
        view = _waited_host_view(tensors, opts)
        if view is not None:
            self._now("broadcast", lambda: self._comm.broadcast(view, root=opts.rootRank))
            return None
        t = self._one(tensors, "broadcast")
        opts = opts or dist.BroadcastOptions()
        root = opts.rootRank
        return self._in_place(
            "broadcast", t, lambda buf: self._comm.broadcast_async(buf, root=root), opts
        )

    def barrier(self, opts: Any = None) -> WorkDDL:
        def start() -> tuple[list[Any], Callable[[], None] | None]:
            self._comm.barrier()  # in order behind the queued collectives; no handle to wait on
            return [], None

        return self._run("barrier", [], start)

    def _gather_into(self, what: str, output: torch.Tensor, input: torch.Tensor) -> Any:
        """Start an allgather of ``input`` into the flat, contiguous ``output``."""
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"ddl backend, {what}: the output has {output.numel()} elements, "
                f"not {self.size()} x the input's {input.numel()}"
            )
        return self._comm.allgather_async(_contiguous(input).reshape(-1), out=output.view(-1))

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> WorkDDL:
        t = self._one(input_tensors, "allgather")
        outputs = self._one(output_tensors, "allgather")  # type: ignore[arg-type]
        if len(outputs) != self.size() or any(o.numel() != t.numel() for o in outputs):
            raise ValueError(
                f"ddl backend, allgather: the output list needs {self.size()} "
                f"tensors of {t.numel()} elements each"
            )

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            flat = torch.empty(t.numel() * self.size(), dtype=t.dtype, device=t.device)
            handle = self._gather_into("allgather", flat, t)

            def finish() -> None:
                for out, piece in zip(outputs, flat.view(self.size(), t.numel()), strict=True):
                    out.copy_(piece.view_as(out))

            return [handle], finish

        return self._run("allgather", list(outputs), start, opts)

    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> WorkDDL:
        """``dist.all_gather_into_tensor``: every rank's ``input`` into ``output``, in order."""
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> WorkDDL:
        outputs, inputs = _all_data(outputs), _all_data(inputs)
        what = "all_gather_into_tensor"

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            handles, copies = [], []
            for out, t in zip(outputs, inputs, strict=True):
                buf = _contiguous(out)
                handles.append(self._gather_into(what, buf, t))
                if buf is not out:
                    copies.append((out, buf))
            return handles, _copier(copies)

        return self._run(what, list(outputs), start, opts)

    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def _scatter_from(self, what: str, output: torch.Tensor, input: torch.Tensor, op: str) -> Any:
        """Start a reduce_scatter of the flat ``input`` into the contiguous ``output``."""
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"ddl backend, {what}: the input has {input.numel()} elements, "
                f"not {self.size()} x the output's {output.numel()}"
            )
        return self._comm.reduce_scatter_async(
            _contiguous(input).reshape(-1), op=op, out=output.view(-1)
        )

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> WorkDDL:
        from ddlcore.integrations.torch._common import pack_into

        out = self._one(output_tensors, "reduce_scatter")
        inputs = self._one(input_tensors, "reduce_scatter")  # type: ignore[arg-type]
        op = _op(opts or dist.ReduceScatterOptions(), "reduce_scatter")
        if len(inputs) != self.size() or any(t.numel() != out.numel() for t in inputs):
            raise ValueError(
                f"ddl backend, reduce_scatter: the input list needs {self.size()} "
                f"tensors of {out.numel()} elements each"
            )

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            flat = torch.empty(out.numel() * self.size(), dtype=out.dtype, device=out.device)
            pack_into(flat, [t.to(out.dtype) for t in inputs])
            buf = _contiguous(out)
            handle = self._scatter_from("reduce_scatter", buf, flat, op)
            return [handle], _copier([] if buf is out else [(out, buf)])

        return self._run("reduce_scatter", [out], start, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> WorkDDL:
        """``dist.reduce_scatter_tensor``: ``input`` reduced, block ``rank`` into ``output``."""
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> WorkDDL:
        outputs, inputs = _all_data(outputs), _all_data(inputs)
        what = "reduce_scatter_tensor"
        op = _op(opts or dist.ReduceScatterOptions(), what)

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            handles, copies = [], []
            for out, t in zip(outputs, inputs, strict=True):
                buf = _contiguous(out)
                handles.append(self._scatter_from(what, buf, t, op))
                if buf is not out:
                    copies.append((out, buf))
            return handles, _copier(copies)

        return self._run(what, list(outputs), start, opts)

    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: Any = None,
    ) -> WorkDDL:
        """``dist.all_gather_coalesced``: each of ``inputs`` from every rank, ``output_lists[r]``
        rank r's; one allgather of their bytes packed together (any dtypes, complex too)."""
        what, size = "all_gather_coalesced", self.size()
        inputs, outputs = _all_data(inputs), [_all_data(lst) for lst in output_lists]
        if len(outputs) != size or any(
            len(lst) != len(inputs)
            or any(
                o.numel() != t.numel() or o.dtype != t.dtype
                for o, t in zip(lst, inputs, strict=False)
            )
            for lst in outputs
        ):
            raise ValueError(
                f"ddl backend, {what}: the output needs {size} lists, each with a tensor of the "
                "dtype and element count of every input tensor, in order"
            )
        nbytes = [t.numel() * t.element_size() for t in inputs]
        device = inputs[0].device if inputs else torch.device("cpu")

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            flat = torch.empty(sum(nbytes), dtype=torch.uint8, device=device)
            offsets = [0, *itertools.accumulate(nbytes)][: len(nbytes)]
            for t, at, n in zip(inputs, offsets, nbytes, strict=True):
                flat[at : at + n].copy_(_contiguous(t).view(-1).view(torch.uint8))
            got = torch.empty(sum(nbytes) * size, dtype=torch.uint8, device=device)
            handle = self._comm.allgather_async(flat, out=got)

            def finish() -> None:
                rows = got.view(size, sum(nbytes))
                for row, lst in zip(rows, outputs, strict=True):
                    for out, at, n in zip(lst, offsets, nbytes, strict=True):
                        # A copy first: the bytes at ``at`` need not be aligned for out's dtype.
                        out.copy_(row[at : at + n].clone().view(out.dtype).view(out.shape))

            return [handle], finish

        return self._run(what, [o for lst in outputs for o in lst], start, opts)

    # --- point-to-point (batch_isend_irecv calls these per op) ------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> WorkDDL:
        t = self._one(tensors, "send")

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            # CUDA or strided tensors leave through a contiguous host copy (p2p moves host
            # memory), taken now; a host contiguous ``t`` is sent as it is.
            buf = _contiguous(t.detach().cpu())
            return [self._comm.isend(buf, dst, tag)], None

        return self._run(f"send to rank {dst}", [t], start)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> WorkDDL:
        return self._recv(tensors, src, tag, f"recv from rank {src}")

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> WorkDDL:
        """``dist.recv(src=None)``: the next message with ``tag`` from any rank; the work's
        ``_source_rank()`` names the sender."""
        from ddlcore.p2p import ANY_SOURCE

        return self._recv(tensors, ANY_SOURCE, tag, "recv from any rank")

    def _recv(self, tensors: list[torch.Tensor], src: int, tag: int, what: str) -> WorkDDL:
        t = self._one(tensors, "recv")
        receives: list[Any] = []

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            direct = not t.is_cuda and t.is_contiguous()
            buf = t if direct else torch.empty(t.shape, dtype=t.dtype)
            receives.append(self._comm.irecv(buf, src, tag))
            return receives, _copier([] if direct else [(t, buf)])

        work = self._run(what, [t], start)
        work._receive = receives[0]
        return work


def _timeout_seconds(timeout: timedelta) -> float | None:
    """torch's timeout in seconds; None (DDL_TIMEOUT's) for torch's default, when DDL_TIMEOUT
    is set: an explicit ``init_process_group(timeout=)`` wins, then DDL_TIMEOUT."""
    from ddlcore import config

    default = getattr(dist.constants, "default_pg_timeout", None)
    if timeout == default and config.is_set("DDL_TIMEOUT"):
        return None
    return _seconds(timeout)


def _create(opts: Any, backend_options: Any = None) -> ProcessGroupDDL:
    """torch's creator: a `ProcessGroupDDL` over a Communicator met through torch's store."""
    import ddlcore

    rank, size = opts.group_rank, opts.group_size
    ranks = list(opts.global_ranks_in_group)
    if ranks and dist.is_initialized() and len(ranks) != dist.get_world_size():
        return _subgroup(rank, size, ranks)
    try:
        comm = ddlcore.init(
            store=opts.store, rank=rank, size=size, timeout=_timeout_seconds(opts.timeout)
        )
    except ddlcore.DDLError as exc:
        raise _dist_error(exc, f"rank {rank}: init_process_group") from None
    group = ProcessGroupDDL(comm, rank, size, comm.timeout)
    if not ranks or len(ranks) == size:  # over every rank: subgroups are made from one
        _world.append(group)
    return group


# The process groups over every rank (`_subgroup` takes the last still open), and how many
# groups over each list of ranks this process made (every member makes them in the same
# order, as torch asks).
_world: list[ProcessGroupDDL] = []
_groups_made: dict[tuple[int, ...], int] = {}


def _subgroup(rank: int, size: int, ranks: list[int]) -> ProcessGroupDDL:
    """new_group(ranks=...) over some of the ranks: only its members get here, and they join
    a child of the world's communicator (`Communicator.split`'s way, under a namespace named
    after the ranks), as MPI_Comm_create_group does."""
    _world[:] = [g for g in _world if not g._comm.closed]
    world = _world[-1]._comm if _world else None
    if world is None or world.rank != dist.get_rank():
        raise dist.DistBackendError(
            f"ddl backend, rank {rank}: a process group over some of the ranks ({len(ranks)} "
            f"of {dist.get_world_size()}) is made from the default group, which is not a "
            "running ddl group; init_process_group('ddl') first, or use backend='gloo'"
        )
    key = tuple(ranks)
    _groups_made[key] = made = _groups_made.get(key, 0) + 1
    try:
        comm = world.join_group(rank, size, f"torch/{'.'.join(map(str, key))}/{made}")
    except BaseException as exc:
        raise _dist_error(exc, f"rank {rank}: new_group(ranks={ranks})") from None
    return ProcessGroupDDL(comm, rank, size, comm.timeout)
