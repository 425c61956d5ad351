"""The Horovod-style optimizer wrapper: gradients fused into buckets and allreduced during backward.

    opt = DistributedOptimizer(opt, comm, model.named_parameters())

Buckets hold up to ``DDL_FUSION_BYTES`` of gradients of one dtype and device, filled from the
last parameter to the first (the order backward produces them). A post-accumulate-grad hook on
each parameter counts it ready; a full bucket is packed (the fused host pack kernel) and
allreduced asynchronously, buckets strictly in order so every rank issues the same collectives
in the same order. `step()` waits for the rest and unpacks the averages into ``p.grad``::

    backward:  layer N grads .. layer k grads | layer k-1 .. layer 1 grads | step()
    wire:                     [allreduce b0 ] |          [allreduce b1   ] | wait, unpack, update

Which buckets backward completes can differ between ranks (a parameter unused on one rank), so
before any other collective on the communicator (a loss logged between backward and `step()`)
the remaining buckets are sent first, on every rank (`Communicator.add_before_collective`).
Each bucket also carries one "had a gradient" flag per parameter: a parameter no rank computed
a gradient for keeps ``p.grad = None``, as in single-process training.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ddlcore import config
from ddlcore.communicator import Communicator
from ddlcore.errors import DDLError, ParametersDifferError
from ddlcore.handles import Handle
from ddlcore.integrations.torch._common import (
    check_same_layout,
    communicator,
    nbytes,
    pack_into,
    unpack_from,
    wire_dtype,
)

# The first bucket (the last layers) is capped lower, as DDP does, so that communication starts
# early in backward even when the whole model would fit in one DDL_FUSION_BYTES bucket.
FIRST_BUCKET_BYTES = 1 << 20


class _Bucket:
    """Gradients of consecutive parameters (same dtype and device) reduced as one buffer: their
    elements, then one flag per parameter (1 where this rank had a gradient)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.flat: torch.Tensor | None = None
        self.wire: torch.Tensor | None = None
        self.ready = 0
        self.handle: Handle | None = None
        # CUDA: recorded after the last step's unpack read the buffers (on step()'s stream);
        # the next pack waits for it on its own stream, which may be another one
        self.consumed: Any = None

    def buffers(self, compressed: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.flat is None:
            p = self.params[0]
            total = self.numel + len(self.params)
            self.flat = torch.empty(total, dtype=p.dtype, device=p.device)
            self.wire = (
                self.flat
                if compressed in (None, p.dtype)
                else torch.empty(total, dtype=compressed, device=p.device)
            )
        assert self.wire is not None
        return self.flat, self.wire


def _build_buckets(params: list[torch.nn.Parameter], fusion_bytes: int) -> list[_Bucket]:
    """Fill buckets from the LAST parameter backwards (the order backward produces gradients),
    closing one when it would pass its cap (``FIRST_BUCKET_BYTES`` for the first, then
    ``fusion_bytes``) or the dtype or device changes."""
    buckets: list[_Bucket] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for p in reversed(params):
        size_p = nbytes(p)
        cap = min(fusion_bytes, FIRST_BUCKET_BYTES) if not buckets else fusion_bytes
        if current and (
            size + size_p > cap or p.dtype != current[0].dtype or p.device != current[0].device
        ):
            buckets.append(_Bucket(current))
            current, size = [], 0
        current.append(p)
        size += size_p
    if current:
        buckets.append(_Bucket(current))
    return buckets


def _checksum(p: torch.Tensor) -> int:
    """CRC of the parameter's bytes: exact, unlike a float sum whose last bits depend on how many
    threads summed it."""
    raw = p.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy()
    return zlib.crc32(raw.tobytes())  # a copy, once per tensor at the first step


class _GradientSync:
    """The state behind a `DistributedOptimizer`: buckets, the hooks that fill them, and the
    collectives that reduce them."""

    def __init__(
        self,
        comm: Communicator,
        op: str,
        compressed: torch.dtype | None,
        passes_per_step: int,
        fusion_bytes: int,
        check_parameters: bool,
    ) -> None:
        self.comm = comm
        self.op = op
        self.compressed = compressed
        self.passes_per_step = passes_per_step
        self.fusion_bytes = fusion_bytes
        self.check_parameters = check_parameters
        self.names: dict[int, str] = {}
        self.params: list[torch.nn.Parameter] = []
        self.buckets: list[_Bucket] = []
        self.bucket_of: dict[int, _Bucket] = {}
        self.passes: dict[int, int] = {}
        self.next = 0  # the next bucket to send
        self.dirty = False  # a hook fired since the last finish()
        self.lock = threading.Lock()
        # .busy: this thread is starting a bucket's allreduce with the lock held, so the
        # communicator's before-collective hook (flush) must not take the lock again
        self.local = threading.local()
        self.hooks: list[Any] = []
        self.unwrapped: Any = None  # the optimizer given to DistributedOptimizer
        comm.add_before_collective(self.flush)

    # --- set-up: every rank, same parameters ----------------------------------------------------
    def attach(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None,
    ) -> None:
        """(Re)build the buckets and hooks for the parameters of ``optimizer.param_groups`` that
        require a gradient; a collective (the same-model check)."""
        params: list[torch.nn.Parameter] = []
        seen: set[int] = set()
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
                    self.names.setdefault(id(p), f"param_groups[{g}][{i}]")
        for name, p in named_parameters or ():
            self.names[id(p)] = name
        check_same_layout(
            self.comm, [(self.names[id(p)], p) for p in params], "DistributedOptimizer"
        )
        for hook in self.hooks:
            hook.remove()
        self.params = params
        self.buckets = _build_buckets(params, self.fusion_bytes)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.hooks = [p.register_post_accumulate_grad_hook(self.grad_ready) for p in params]

    # --- during backward ------------------------------------------------------------------------
    def grad_ready(self, p: torch.nn.Parameter) -> None:
        """Post-accumulate-grad hook: runs in backward once ``p.grad`` holds this pass's sum."""
        with self.lock:
            bucket = self.bucket_of[id(p)]
            passes = self.passes[id(p)] = self.passes.get(id(p), 0) + 1
            if bucket.handle is not None or passes > self.passes_per_step:
                raise DDLError(
                    f"rank {self.comm.rank}: DistributedOptimizer: {self.names[id(p)]} got a "
                    f"gradient after its bucket was sent (more than backward_passes_per_step="
                    f"{self.passes_per_step} backward passes since the last step(), or a "
                    "backward after a collective that sent the buckets); call step() or "
                    "synchronize() after each step's backward passes, or zero_grad() to drop "
                    "the gradients"
                )
            self.dirty = True
            if passes == self.passes_per_step:
                bucket.ready += 1
                while self.next < len(self.buckets) and self.buckets[self.next].ready == len(
                    self.buckets[self.next].params
                ):
                    self._send_next()

    def _send_next(self) -> None:
        """Pack and start the allreduce of bucket ``self.next`` (lock held)."""
        bucket = self.buckets[self.next]
        self.next += 1
        flat, wire = bucket.buffers(self.compressed)
        had = [p.grad is not None for p in bucket.params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        op = self.op
        with torch.no_grad():
            if bucket.consumed is not None:
                torch.cuda.current_stream(flat.device).wait_event(bucket.consumed)
            pack_into(flat[: bucket.numel], grads)
            flags = flat[bucket.numel :]
            flags.fill_(1)  # kernels, not a copy from the host (which would synchronise)
            for i in (i for i, h in enumerate(had) if not h):
                flags[i].fill_(0)
            if wire is not flat:
                if op == "avg":  # divided before the cast: no extra rounding, no fp16 overflow
                    flat.div_(self.comm.size)
                    op = "sum"
                wire.copy_(flat)
        # no host synchronisation: on a GPU the collective waits for the packing kernel
        # (queued on this thread's current stream, which it records an event on)
        self.local.busy = True
        try:
            bucket.handle = self.comm.allreduce_async(wire, op=op, out=wire)
        finally:
            self.local.busy = False

    def _send_rest(self) -> None:
        """Start every bucket not sent yet, in order (lock held)."""
        while self.next < len(self.buckets):
            self._send_next()

    def flush(self) -> None:
        """Before another collective on the communicator: send every bucket not sent yet, so
        that collective comes after the same buckets on every rank."""
        if getattr(self.local, "busy", False):
            return
        with self.lock:
            if not self.dirty:
                return
            self._send_rest()

    # --- before the update ----------------------------------------------------------------------
    def finish(self, apply: bool) -> None:
        """Send what is left, wait for every bucket, and (if ``apply``) write the reduced
        gradients into ``p.grad``; without ``apply`` they are dropped (zero_grad)."""
        with self.lock:
            if not self.dirty:
                return
            self._send_rest()
            buckets = list(self.buckets)
        try:
            with torch.no_grad():
                for bucket in buckets:
                    assert bucket.handle is not None
                    bucket.handle.wait()
                    if apply:
                        self._unpack(bucket)
        finally:
            with self.lock:
                for bucket in self.buckets:
                    bucket.ready, bucket.handle = 0, None
                self.passes.clear()
                self.next = 0
                self.dirty = False
        if apply and self.check_parameters:
            self.check_parameters = False
            self.verify_parameters()

    def _unpack(self, bucket: _Bucket) -> None:
        flat, wire = bucket.buffers(self.compressed)
        if wire is not flat:
            flat.copy_(wire)
        had_any = (flat[bucket.numel :] != 0).tolist()
        targets = []
        for p, had in zip(bucket.params, had_any, strict=True):
            if not had:  # no rank computed one: stays None, as in single-process training
                p.grad = None
                targets.append(torch.empty_like(p))  # receives the zeros nobody needs
                continue
            if p.grad is None:  # not used here, used elsewhere: the average counts our zero
                p.grad = torch.empty_like(p)
            targets.append(p.grad)
        unpack_from(flat[: bucket.numel], targets)
        if flat.is_cuda:
            bucket.consumed = torch.cuda.Event()
            bucket.consumed.record(torch.cuda.current_stream(flat.device))

    def verify_parameters(self) -> None:
        """Once, before the first update: the ranks' parameters agree, or every rank raises."""
        mine = np.array([_checksum(p) for p in self.params], np.int64)
        every = self.comm.allgather(mine).reshape(self.comm.size, -1)
        for rank in range(1, self.comm.size):
            differ = np.flatnonzero(every[rank] != every[0])
            if differ.size:
                names = ", ".join(self.names[id(self.params[i])] for i in differ[:3])
                raise ParametersDifferError(
                    f"DistributedOptimizer: at the first step rank {rank}'s parameters differ from "
                    f"rank 0's ({differ.size} tensors, e.g. {names}); call "
                    "broadcast_parameters(model, comm) once after building the model (and "
                    "broadcast_optimizer_state(optimizer, comm) after loading a checkpoint)"
                )


class _DistributedOptimizerMixin:
    """What `DistributedOptimizer` puts in front of the wrapped optimizer's class."""

    _ddl: _GradientSync

    def synchronize(self) -> None:
        """Finish reducing every gradient and write the results into ``p.grad``.

        `step()` calls it. Call it yourself to work on the reduced gradients before the update
        (clipping, ``GradScaler.unscale_``): `step()` then does not reduce them again. Changes
        made to ``p.grad`` after backward but before `synchronize` are overwritten by it."""
        self._ddl.finish(apply=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients on every rank (the buckets in flight are waited for and
        discarded), then the wrapped optimizer's ``zero_grad``."""
        self._ddl.finish(apply=False)
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Wait for the reduced gradients (`synchronize`), then take the wrapped optimizer's step.
        A ``closure`` (LBFGS) has its gradients reduced each time the optimizer calls it."""
        self.synchronize()
        # what an LR scheduler built on the unwrapped optimizer watches to know step() ran
        self._ddl.unwrapped._opt_called = True
        if closure is None:
            return super().step()  # type: ignore[misc]

        def reduced_closure() -> Any:
            loss = closure()
            self.synchronize()
            return loss

        return super().step(reduced_closure)  # type: ignore[misc]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The wrapped optimizer's ``add_param_group``; the new parameters get buckets and hooks.
        A collective: every rank adds the same group."""
        super().add_param_group(param_group)  # type: ignore[misc]
        if "_ddl" in self.__dict__:
            self._ddl.finish(apply=False)
            self._ddl.attach(self, None)  # type: ignore[arg-type]


# torch wraps an optimizer class's step() in its profiling hooks when one is built or loads a
# state dict; the wrapped class's step() already is, and a second wrapper would run hooks twice.
setattr(_DistributedOptimizerMixin.step, "hooked", True)  # noqa: B010


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    comm: Communicator,  # noqa: N802
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]] | None = None,
    *,
    fusion_bytes: int | None = None,
    compression: Any = None,
    op: str = "avg",
    backward_passes_per_step: int = 1,
    check_parameters: bool = True,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients averaged over every rank.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        The local optimizer. The wrapper is an instance of its class (LR schedulers,
        ``state_dict()``, ``zero_grad()`` work as before) and takes over its state: use the
        wrapper from here on, and wrap once.
    comm : Communicator
        The ranks to average over (``ddlcore.init()``).
    named_parameters : iterable of (name, parameter), optional
        ``model.named_parameters()``: names for messages. Default: positions in param_groups.
    fusion_bytes : int, optional
        Bucket size (default ``DDL_FUSION_BYTES``, 25 MiB; the first bucket, the last layers,
        at most 1 MiB so that communication starts early in backward).
    compression : None, "fp16" or "bf16"
        Send gradients in a 16-bit type (halves the bytes; parameters stay in their dtype).
    op : "avg" or "sum"
        How gradients combine across ranks (Horovod's default is the average).
    backward_passes_per_step : int
        Backward passes that accumulate into ``p.grad`` before the gradients are reduced.
    check_parameters : bool
        At the first step, check that every rank holds the same parameters (one allgather of
        a CRC per tensor) and raise `ParametersDifferError` if not.

    Returns
    -------
    torch.optim.Optimizer
        The wrapper. Parameters that do not require a gradient when wrapped (frozen) are not
        reduced; `add_param_group` on the wrapper registers new ones.

    Raises
    ------
    TypeError, ValueError
        Bad arguments (``comm`` not a Communicator, unknown ``op`` or ``compression``,
        ``optimizer`` already wrapped).
    CollectiveMismatchError
        The ranks' parameters differ in names, shapes or dtypes (on every rank, naming the
        first rank that differs).
    """
    comm = communicator(comm, "DistributedOptimizer")
    if op not in ("avg", "sum"):
        raise ValueError(f"op={op!r}: use 'avg' or 'sum'")
    if (
        isinstance(backward_passes_per_step, bool)
        or not isinstance(backward_passes_per_step, int)
        or backward_passes_per_step < 1
    ):
        raise ValueError(
            f"backward_passes_per_step={backward_passes_per_step!r} must be an int >= 1"
        )
    fusion = config.get("DDL_FUSION_BYTES") if fusion_bytes is None else int(fusion_bytes)
    if fusion < 1:
        raise ValueError(f"fusion_bytes={fusion_bytes!r} must be positive")
    compressed = wire_dtype(compression)
    if isinstance(optimizer, _DistributedOptimizerMixin):
        raise ValueError("optimizer is already a DistributedOptimizer")

    sync = _GradientSync(comm, op, compressed, backward_passes_per_step, fusion, check_parameters)
    cls = type(
        f"Distributed{type(optimizer).__name__}", (_DistributedOptimizerMixin, type(optimizer)), {}
    )
    wrapped: Any = object.__new__(cls)  # not cls(...): the wrapped optimizer's state is reused
    # Same param_groups and state objects. Not an instance-level `step`: an LR scheduler built
    # before wrapping puts one there, bound to the unwrapped optimizer (it would skip the sync).
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    sync.attach(wrapped, named_parameters)
    sync.unwrapped = optimizer
    wrapped._ddl = sync
    return wrapped
