"""DDP communication hooks: DDP keeps its buckets and hands each one to ddlcore.

    model = DDP(model)                                 # torch.distributed (gloo) for DDP's setup
    model.register_comm_hook(comm, allreduce_hook)     # or fp16_allreduce_hook, bf16_allreduce_hook

Each bucket is allreduced asynchronously on the communicator's worker while backward goes on;
the future DDP waits for completes from the handle's done-callback.
"""

# No ``from __future__ import annotations`` here: DDP compares the hooks' annotations with the
# real objects (dist.GradBucket, torch.futures.Future[torch.Tensor]), not with strings.
import torch
import torch.distributed as dist

from ddlcore.communicator import Communicator
from ddlcore.handles import Handle
from ddlcore.integrations.torch._common import communicator


def _allreduce_future(
    comm: Communicator, tensor: torch.Tensor, wire_dtype: torch.dtype | None
) -> torch.futures.Future[torch.Tensor]:
    """Average ``tensor`` over the ranks, in place; the future completes with ``tensor``.

    With a ``wire_dtype`` the data travels compressed: divided by the number of ranks first (in
    the bucket's dtype: one rounding, and an fp16 sum of undivided gradients overflows sooner),
    cast, summed, cast back.

    No host synchronisation: the collective waits on the GPU for the work queued on the
    caller's stream (the division and the cast included). A future of CUDA tensors must name
    their device: completing it records an event on that device's current stream of the
    completing thread (the communicator's worker, after the collective and the copy back), and
    DDP's wait makes its own stream wait for that event."""
    devices: list[int | str | torch.device] | None = [tensor.device] if tensor.is_cuda else None
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=devices)
    if wire_dtype is None or wire_dtype == tensor.dtype:
        wire, op = tensor, "avg"
    else:
        wire, op = tensor.div_(comm.size).to(wire_dtype), "sum"

    def settle(handle: Handle) -> None:
        try:
            handle.wait(0)
            if wire is not tensor:
                tensor.copy_(wire)  # on this (worker) thread's current stream
                if wire.is_cuda:  # wire's memory must outlive the copy, not just this closure
                    wire.record_stream(torch.cuda.current_stream(wire.device))
            future.set_result(tensor)
        except BaseException as exc:  # the future carries the collective's error to DDP
            future.set_exception(exc)  # type: ignore[arg-type]  # torch's stub says Tensor

    comm.allreduce_async(wire, op=op, out=wire).add_done_callback(settle)
    return future


def allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the bucket's gradients over the ranks with ddlcore.

    Register with ``ddp_model.register_comm_hook(comm, allreduce_hook)``; ``state`` is the
    ddlcore communicator. The allreduce runs asynchronously on the communicator's worker while
    backward goes on producing the next buckets.
    """
    return _allreduce_future(communicator(state, "allreduce_hook"), bucket.buffer(), None)


def fp16_allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Like `allreduce_hook`, with the gradients sent as float16 (half the bytes)."""
    return _allreduce_future(
        communicator(state, "fp16_allreduce_hook"), bucket.buffer(), torch.float16
    )


def bf16_allreduce_hook(
    state: Communicator, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Like `allreduce_hook`, with the gradients sent as bfloat16 (half the bytes, float32's
    exponent range).

    Not named like torch's ``bf16_compress_hook``: DDP refuses a hook of that name unless NCCL
    is there."""
    return _allreduce_future(
        communicator(state, "bf16_allreduce_hook"), bucket.buffer(), torch.bfloat16
    )
