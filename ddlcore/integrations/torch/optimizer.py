"""The Horovod-style optimizer wrapper: gradients fused into buckets and allreduced during backward.

    opt = DistributedOptimizer(opt, comm, model.named_parameters())

Buckets hold up to ``DDL_FUSION_BYTES`` of gradients of one dtype and device, filled from the
last parameter to the first (the order backward produces them). A post-accumulate-grad hook on
each parameter counts it ready; a full bucket is packed (the fused host pack kernel) and
allreduced asynchronously, buckets strictly in order so every rank issues the same collectives
in the same order. `step()` waits for the rest and unpacks the averages into ``p.grad``::

    backward:  layer N grads .. layer k grads | layer k-1 .. layer 1 grads | step()
    wire:                     [allreduce b0 ] |          [allreduce b1   ] | wait, unpack, update
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ddlcore import config
from ddlcore.communicator import Communicator
from ddlcore.errors import DDLError
from ddlcore.handles import Handle
from ddlcore.integrations.torch._common import (
    check_same_layout,
    communicator,
    nbytes,
    pack_into,
    settle_stream,
    unpack_from,
    wire_dtype,
)


class ParametersDifferError(DDLError):
    """The ranks' parameters were not the same at the first synchronised step."""


class _Bucket:
    """Gradients of consecutive parameters (same dtype and device) reduced as one buffer."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None
        self.ready = 0
        self.handle: Handle | None = None

    def buffers(self, compressed: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flat is None:
            p = self.params[0]
            self.flat = torch.empty(self.numel, dtype=p.dtype, device=p.device)
            self.wire = self.flat if compressed in (None, p.dtype) else \
                torch.empty(self.numel, dtype=compressed, device=p.device)
        assert self.wire is not None
        return self.flat, self.wire


def _build_buckets(params: list[torch.nn.Parameter], fusion_bytes: int) -> list[_Bucket]:
    """Fill buckets from the LAST parameter backwards (the order backward produces gradients),
    closing one when it would pass ``fusion_bytes`` or the dtype or device changes."""
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        size_p = nbytes(p)
        if current and (size + size_p > fusion_bytes or p.dtype != current[0].dtype
                        or p.device != current[0].device):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += size_p
    if current:
        buckets.append(_Bucket(current))
    return buckets


class _DistributedOptimizerMixin:
    """Methods that `DistributedOptimizer` puts in front of the wrapped optimizer's class."""

    _ddl_comm: Communicator
    _ddl_params: list[torch.nn.Parameter]
    _ddl_buckets: list[_Bucket]
    _ddl_bucket_of: dict[int, _Bucket]
    _ddl_names: dict[int, str]
    _ddl_passes: dict[int, int]
    _ddl_passes_per_step: int
    _ddl_wire_dtype: torch.dtype | None
    _ddl_op: str
    _ddl_lock: threading.Lock
    _ddl_next: int
    _ddl_dirty: bool
    _ddl_check_parameters: bool
    _ddl_hooks: list[Any]

    def _ddl_grad_ready(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs in backward once ``p.grad`` holds this pass's sum."""
        with self._ddl_lock:
            self._ddl_dirty = True
            key = id(p)
            self._ddl_passes[key] = self._ddl_passes.get(key, 0) + 1
            if self._ddl_passes[key] != self._ddl_passes_per_step:
                return
            bucket = self._ddl_bucket_of[key]
            bucket.ready += 1
            while (self._ddl_next < len(self._ddl_buckets)
                   and self._ddl_buckets[self._ddl_next].ready == len(
                       self._ddl_buckets[self._ddl_next].params)):
                self._ddl_launch(self._ddl_buckets[self._ddl_next])
                self._ddl_next += 1

    def _ddl_launch(self, bucket: _Bucket) -> None:
        flat, wire = bucket.buffers(self._ddl_wire_dtype)
        grads = []
        for p in bucket.params:
            if p.grad is None:  # unused in this backward here, maybe not on another rank
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        with torch.no_grad():
            pack_into(flat, grads)
            op = self._ddl_op
            if wire is not flat:
                wire.copy_(flat)
                if op == "avg":  # pre-divided: the compressed sum does not overflow sooner
                    wire.div_(self._ddl_comm.size)
                    op = "sum"
        settle_stream(wire)
        bucket.handle = self._ddl_comm.allreduce_async(wire, op=op, out=wire)

    def synchronize(self) -> None:
        """Finish reducing every gradient (launching buckets backward did not complete, e.g.
        for parameters it did not reach) and write the results into ``p.grad``.

        `step()` calls it; call it yourself to work on the reduced gradients first (clipping,
        say): `step()` will not reduce them again."""
        with self._ddl_lock:
            if not self._ddl_dirty:
                return
            while self._ddl_next < len(self._ddl_buckets):
                self._ddl_launch(self._ddl_buckets[self._ddl_next])
                self._ddl_next += 1
            buckets = list(self._ddl_buckets)
        with torch.no_grad():
            for bucket in buckets:
                assert bucket.handle is not None and bucket.flat is not None
                bucket.handle.wait()
                if bucket.wire is not None and bucket.wire is not bucket.flat:
                    bucket.flat.copy_(bucket.wire)
                grads = [p.grad for p in bucket.params]  # every one was set by _ddl_launch
                unpack_from(bucket.flat, [g for g in grads if g is not None])
        with self._ddl_lock:
            for bucket in self._ddl_buckets:
                bucket.ready, bucket.handle = 0, None
            self._ddl_passes.clear()
            self._ddl_next = 0
            self._ddl_dirty = False
        if self._ddl_check_parameters:
            self._ddl_check_parameters = False
            self._ddl_verify_parameters()

    def _ddl_verify_parameters(self) -> None:
        """Once, before the first update: the ranks' parameters agree, or every rank raises."""
        params = self._ddl_params
        with torch.no_grad():
            mine = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()])
                                for p in params]).cpu().numpy().reshape(-1) if params else \
                np.zeros(0)
        every = self._ddl_comm.allgather(np.ascontiguousarray(mine)).reshape(self._ddl_comm.size, -1)
        for rank in range(1, self._ddl_comm.size):
            differ = np.flatnonzero(np.any((every[rank] != every[0]).reshape(-1, 2), axis=1))
            if differ.size:
                names = ", ".join(self._ddl_names[id(params[i])] for i in differ[:3])
                raise ParametersDifferError(
                    f"DistributedOptimizer: at the first step rank {rank}'s parameters differ from "
                    f"rank 0's ({differ.size} tensors, e.g. {names}); call "
                    "broadcast_parameters(model, comm) once after building the model (and "
                    "broadcast_optimizer_state(optimizer, comm) after loading a checkpoint)")

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the reduced gradients (`synchronize`), then take the wrapped optimizer's step."""
        self.synchronize()
        return super().step(closure)  # type: ignore[misc]


def DistributedOptimizer(optimizer: torch.optim.Optimizer, comm: Communicator,  # noqa: N802
                         named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
                         *, fusion_bytes: int | None = None, compression: Any = None,
                         op: str = "avg", backward_passes_per_step: int = 1,
                         check_parameters: bool = True) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The local optimizer; the wrapper is an instance of its class (LR schedulers,
        ``state_dict()`` and ``zero_grad()`` work as before) sharing its state.
    comm : Communicator
    named_parameters : iterable of (name, parameter), optional
        ``model.named_parameters()``: names for messages. Default: positions in param_groups.
    fusion_bytes : int, optional
        Bucket size (default ``DDL_FUSION_BYTES``, 25 MiB).
    compression : None, "fp16" or "bf16"
        Send gradients in a 16-bit type (halves the bytes; parameters stay in their dtype).
    op : "avg" or "sum"
        How gradients combine across ranks (Horovod's default is the average).
    backward_passes_per_step : int
        Backward passes that accumulate into ``p.grad`` before the gradients are reduced.
    check_parameters : bool
        At the first step, check that every rank holds the same parameters (one allgather of
        two numbers per tensor) and raise `ParametersDifferError` if not.

    Every rank must wrap an optimizer over the same parameters (checked here: a
    `CollectiveMismatchError` on every rank says which rank differs).
    """
    comm = communicator(comm, "DistributedOptimizer")
    if op not in ("avg", "sum"):
        raise ValueError(f"op={op!r}: use 'avg' or 'sum'")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1")
    fusion = config.get("DDL_FUSION_BYTES") if fusion_bytes is None else int(fusion_bytes)
    if fusion < 1:
        raise ValueError(f"fusion_bytes={fusion_bytes!r} must be positive")
    wire = wire_dtype(compression)
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("optimizer is already a DistributedOptimizer")

    params: list[torch.nn.Parameter] = []
    names: dict[int, str] = {}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p.requires_grad and id(p) not in names:
                params.append(p)
                names[id(p)] = f"param_groups[{g}][{i}]"
    if named_parameters is not None:
        for name, p in named_parameters:
            if id(p) in names:
                names[id(p)] = name
    check_same_layout(comm, [(names[id(p)], p) for p in params], "DistributedOptimizer")

    cls = type(f"Distributed{type(optimizer).__name__}",
               (_DistributedOptimizerMixin, type(optimizer)), {})
    wrapped: Any = object.__new__(cls)  # not cls(...): the wrapped optimizer's state is reused
    wrapped.__dict__.update(optimizer.__dict__)  # same param_groups and state objects
    wrapped._ddl_comm = comm
    wrapped._ddl_params = params
    wrapped._ddl_buckets = _build_buckets(params, fusion)
    wrapped._ddl_bucket_of = {id(p): b for b in wrapped._ddl_buckets for p in b.params}
    wrapped._ddl_names = names
    wrapped._ddl_passes = {}
    wrapped._ddl_passes_per_step = backward_passes_per_step
    wrapped._ddl_wire_dtype = wire
    wrapped._ddl_op = op
    wrapped._ddl_lock = threading.Lock()
    wrapped._ddl_next = 0
    wrapped._ddl_dirty = False
    wrapped._ddl_check_parameters = check_parameters
    wrapped._ddl_hooks = [p.register_post_accumulate_grad_hook(wrapped._ddl_grad_ready)
                          for p in params]
    return wrapped
