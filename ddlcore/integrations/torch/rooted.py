"""The rooted collectives and all-to-all of the "ddl" torch.distributed backend (a base class
of `ProcessGroupDDL`, kept apart to keep its file small): ``dist.reduce``, ``gather``,
``scatter``, ``all_to_all`` and ``all_to_all_single`` on the `Communicator`'s reduce, gather,
scatter, alltoall and alltoallv."""

# torch's stubs name some ProcessGroup arguments differently; the C++ trampoline calls these by
# position, as the overrides below take them.
# mypy: disable-error-code="override"
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddlcore.integrations.torch.work import (
    WorkDDL,
    _all_data,
    _contiguous,
    _copier,
    _data,
    _op,
)


def _split_elements(t: torch.Tensor, rows: Sequence[int], size: int, what: str) -> list[int]:
    """Elements per rank of ``t`` cut along its first dimension into ``rows`` rows each (equal
    parts where ``rows`` is empty), as all_to_all_single's split sizes."""
    first = t.shape[0] if t.dim() else 1
    per_row = t.numel() // first if first else 0
    if not rows:
        if first % size:
            raise ValueError(
                f"ddl backend, all_to_all_single: the {what}'s first dimension ({first}) does "
                f"not divide by the group size {size}; pass {what}_split_sizes"
            )
        rows = [first // size] * size
    if len(rows) != size or sum(rows) != first:
        raise ValueError(
            f"ddl backend, all_to_all_single: {what}_split_sizes {list(rows)} must hold {size} "
            f"row counts adding up to the {what}'s first dimension ({first})"
        )
    return [int(r) * per_row for r in rows]


class RootedCollectives:
    """reduce, gather, scatter, all_to_all, all_to_all_single over `ProcessGroupDDL`'s
    ``_comm``, ``_run``, ``_one`` and ``_in_place``."""

    _comm: Any

    if TYPE_CHECKING:  # ProcessGroupDDL's (and torch's rank and size, after this class)

        def rank(self) -> int: ...

        def size(self) -> int: ...

        def _run(
            self,
            what: str,
            outputs: list[torch.Tensor],
            start: Callable[[], tuple[list[Any], Callable[[], None] | None]],
            opts: Any = None,
        ) -> WorkDDL: ...

        def _one(self, tensors: Sequence[torch.Tensor], what: str) -> torch.Tensor: ...

        def _in_place(
            self, what: str, t: torch.Tensor, run: Callable[[torch.Tensor], Any], opts: Any
        ) -> WorkDDL: ...

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> WorkDDL:
        """``dist.reduce``: the result in the root's tensor; the others' left as they were."""
        t = self._one(tensors, "reduce")
        opts = opts or dist.ReduceOptions()
        op, root = _op(opts, "reduce"), opts.rootRank
        return self._in_place(
            "reduce",
            t,
            lambda buf: self._comm.reduce_async(buf, op=op, root=root, out=buf),
            opts,
        )

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> WorkDDL:
        """``dist.gather``: every rank's tensor into the root's list (empty elsewhere)."""
        t = self._one(input_tensors, "gather")
        opts = opts or dist.GatherOptions()
        root = opts.rootRank
        outputs = [o for lst in output_tensors for o in lst]
        at_root = self.rank() == root
        if at_root and (
            len(outputs) != self.size() or any(o.numel() != t.numel() for o in outputs)
        ):
            raise ValueError(
                f"ddl backend, gather: the root's list needs {self.size()} tensors of "
                f"{t.numel()} elements each"
            )

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            x = _contiguous(t).reshape(-1)
            if not at_root:
                return [self._comm.gather_async(x, root=root)], None
            flat = torch.empty(t.numel() * self.size(), dtype=t.dtype, device=t.device)
            handle = self._comm.gather_async(x, root=root, out=flat)
            pieces = flat.view(self.size(), t.numel())
            return [handle], _copier(
                [(o, p.view_as(o)) for o, p in zip(outputs, pieces, strict=True)]
            )

        return self._run("gather", outputs, start, opts)

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> WorkDDL:
        """``dist.scatter``: tensor r of the root's list into rank r's tensor."""
        from ddlcore.integrations.torch._common import pack_into

        out = self._one(output_tensors, "scatter")
        opts = opts or dist.ScatterOptions()
        root = opts.rootRank
        inputs = [_data(i) for lst in input_tensors for i in lst]
        at_root = self.rank() == root
        if at_root and (
            len(inputs) != self.size() or any(i.numel() != out.numel() for i in inputs)
        ):
            raise ValueError(
                f"ddl backend, scatter: the root's list needs {self.size()} tensors of "
                f"{out.numel()} elements each"
            )

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            flat = None
            if at_root:
                flat = torch.empty(out.numel() * self.size(), dtype=out.dtype, device=out.device)
                pack_into(flat, [i.to(out.dtype) for i in inputs])
            buf = _contiguous(out)
            handle = self._comm.scatter_async(flat, root=root, out=buf.view(-1))
            return [handle], _copier([] if buf is out else [(out, buf)])

        return self._run("scatter", [out], start, opts)

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> WorkDDL:
        """``dist.all_to_all``: input tensor j to rank j, output tensor i from rank i (any
        sizes, as alltoallv)."""
        from ddlcore.integrations.torch._common import pack_into, unpack_from

        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(
                f"ddl backend, all_to_all: {self.size()} input and output tensors needed, got "
                f"{len(input_tensors)} and {len(output_tensors)}"
            )
        output_tensors, input_tensors = _all_data(output_tensors), _all_data(input_tensors)
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        dtype, device = output_tensors[0].dtype, output_tensors[0].device

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            flat = torch.empty(sum(send), dtype=dtype, device=device)
            pack_into(flat, [t.to(dtype) for t in input_tensors])
            got = torch.empty(sum(recv), dtype=dtype, device=device)
            handle = self._comm.alltoallv_async(flat, send, recv, out=got)
            return [handle], lambda: unpack_from(got, list(output_tensors))

        return self._run("all_to_all", list(output_tensors), start, opts)

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> WorkDDL:
        """``dist.all_to_all_single``: ``input``'s rows split by ``input_split_sizes`` (equal
        parts when empty) to the ranks, ``output``'s rows likewise from them."""
        output, input = _data(output), _data(input)
        send = _split_elements(input, input_split_sizes, self.size(), "input")
        recv = _split_elements(output, output_split_sizes, self.size(), "output")

        def start() -> tuple[list[Any], Callable[[], None] | None]:
            buf = _contiguous(output)
            x = _contiguous(input).reshape(-1)
            if not input_split_sizes and not output_split_sizes:
                handle = self._comm.alltoall_async(x, out=buf.view(-1))
            else:
                handle = self._comm.alltoallv_async(x, send, recv, out=buf.view(-1))
            return [handle], _copier([] if buf is output else [(output, buf)])

        return self._run("all_to_all_single", [output], start, opts)

    alltoall_base = all_to_all_single
