"""`WorkDDL`, the handle of one collective of the "ddl" torch.distributed backend in flight; how
a ddlcore error reaches torch (`_dist_error`: a ``DistBackendError`` with ddlcore's message); and
the small steps the backend's collectives share (the op's name, contiguous copies, copying
results back).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ddlcore.handles import Completion

_OPS = {"SUM": "sum", "AVG": "avg", "PRODUCT": "prod", "MIN": "min", "MAX": "max"}


# ddlcore's op names by the value of torch's reduction type. Every call into torch's pybind11
# objects counts: its ``.name`` costs ~10 us, and a lookup by the enum itself (its pybind11
# ``__hash__`` and ``__eq__``) twice what ``.value`` and an int key cost.
_BY_VALUE = {int(getattr(dist.ReduceOp.RedOpType, name).value): op for name, op in _OPS.items()}
_KINDS = dict(dist.ReduceOp.RedOpType.__members__)


def _hash_is_value() -> bool:
    """Whether a ReduceOp's ``hash`` is its type's value (torch 2.x defines it so), which costs
    one pybind11 call where ``.op.value`` costs two. Checked here on every kind torch has (and
    a premultiplied sum, which carries a factor), not assumed: a hash that named a wrong kind
    would reduce with the wrong op."""
    opts = dist.AllreduceOptions()
    ops = [(getattr(dist.ReduceOp, name), kind) for name, kind in _KINDS.items()]
    premul = getattr(dist, "_make_nccl_premul_sum", None)
    if premul is not None and "PREMUL_SUM" in _KINDS:
        ops.append((premul(2.0), _KINDS["PREMUL_SUM"]))
    for op, kind in ops:
        try:
            opts.reduceOp = op
        except TypeError:  # a kind that needs a factor: made by premul above
            continue
        if hash(opts.reduceOp) != int(kind.value):
            return False
    return True


try:
    _HASH_IS_VALUE = _hash_is_value()
except Exception:  # importing the backend must not fail on a torch that differs here
    _HASH_IS_VALUE = False


def _op(opts: Any, what: str) -> str:
    """ddlcore's name of the reduction in torch's ``opts``."""
    reduce_op = opts.reduceOp
    red = _BY_VALUE.get(hash(reduce_op) if _HASH_IS_VALUE else reduce_op.op.value)
    if red is None:
        raise ValueError(
            f"ddl backend, {what}: op=ReduceOp.{opts.reduceOp.op.name} is not supported; "
            f"ddlcore reduces with {', '.join('ReduceOp.' + n for n in _OPS)}"
        )
    return red


def _data(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd: the same memory, which ddlcore reads and writes in place (as
    torch's own backends do; DDP with ``create_graph=True`` hands over tensors that require
    grad, which DLPack refuses)."""
    return t.detach() if t.requires_grad else t


def _all_data(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [_data(t) for t in tensors]


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _copier(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[], None] | None:
    """The finishing step that copies each (destination, buffer) pair back; None for none."""
    if not pairs:
        return None

    def copy() -> None:
        for destination, buf in pairs:
            destination.copy_(buf)

    return copy


def _dist_error(exc: BaseException, what: str) -> BaseException:
    """``exc`` as torch reports a backend's failure: a DistBackendError with ddlcore's message
    (argument errors stay ValueError/TypeError; torch's own errors pass unchanged)."""
    if isinstance(exc, (dist.DistError, ValueError, TypeError)):
        return exc
    error = dist.DistBackendError(f"ddl backend, {what}: {exc}")
    error.__cause__ = exc
    return error


def _seconds(timeout: timedelta | None) -> float | None:
    """Seconds of a torch timeout; None for none (torch's kNoTimeout is 0)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None


class WorkDDL(dist.Work):
    """One collective in flight: its ddlcore handles, then a finishing step (copies into the
    caller's tensors) run on the communicator's worker as the last handle completes."""

    def __init__(self, what: str, outputs: list[torch.Tensor], timeout: float) -> None:
        super().__init__()
        self._what = what
        self._outputs = outputs
        self._timeout = timeout
        # Most works complete before anyone waits (torch's async_op=False runs them on the
        # calling thread): the Event and the future are made only when needed.
        self._done = Completion()
        self._error: BaseException | None = None
        self._receive: Any = None  # a receive's ddlcore handle: its ``source`` once done
        self._handles: Sequence[Any] = ()
        self._future: torch.futures.Future[list[torch.Tensor]] | None = None
        devices = sorted({t.device for t in outputs if t.is_cuda}, key=str)
        self._cuda = bool(devices)
        if devices:
            # A future of CUDA tensors names their devices: completing it records an event on
            # each device's current stream (the one current when the copies were queued), and
            # whoever waits on it makes its stream wait for that.
            self._future = torch.futures.Future(devices=list(devices))

    def _start(self, handles: Sequence[Any], finish: Callable[[], None] | None) -> WorkDDL:
        """Complete once every handle (they finish in order) did and ``finish`` ran."""

        def settle(_: Any) -> None:
            try:
                for handle in handles:
                    handle.wait(0)
                if finish is not None:
                    finish()
            except BaseException as exc:
                self._complete(_dist_error(exc, self._what))
            else:
                self._complete(None)

        if handles:
            self._handles = handles
            handles[-1].add_done_callback(settle)
        else:
            settle(None)
        return self

    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        with self._done.lock:
            event = self._done.mark()
            future = self._future
        if future is not None:
            self._settle(future)
        if event is not None:
            event.set()

    def _settle(self, future: torch.futures.Future[list[torch.Tensor]]) -> None:
        if self._error is None:
            future.set_result(self._outputs)
        else:
            future.set_exception(self._error)  # type: ignore[arg-type]  # the stub says list

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block (without the GIL) until the collective finished; raise its error if it failed.

        ``timeout`` (none: the process group's, for each collective queued before this one and
        this one) passing first raises ``DistBackendError``; the collective keeps running."""
        limit = _seconds(timeout)
        if limit is None:
            for handle in self._handles:  # run here what the worker has not started yet
                handle.run_here()
        if not self._done.wait(self._timeout if limit is None else limit):
            raise dist.DistBackendError(
                f"ddl backend, {self._what}: not complete after waiting "
                f"{self._timeout if limit is None else limit:g} s"
            )
        if self._error is not None:
            raise self._error
        if self._future is not None and self._cuda:
            self._future.wait()  # the caller's current streams wait for the queued copies
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future completed with the output tensors (or the collective's error)."""
        with self._done.lock:
            future, made = self._future, self._future is None
            if made:
                future = self._future = torch.futures.Future()
            completed = self._done.finished
        assert future is not None
        if made and completed:  # _complete ran before it existed: settle it here
            self._settle(future)
        return future

    def _source_rank(self) -> int:
        """The rank a completed receive's message came from (``dist.recv(src=None)``)."""
        if self._receive is None or self._receive.source is None:
            raise ValueError(f"ddl backend, {self._what}: not a completed receive")
        return int(self._receive.source)

    def is_completed(self) -> bool:
        return self._done.finished

    def is_success(self) -> bool:
        return self._done.finished and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs
