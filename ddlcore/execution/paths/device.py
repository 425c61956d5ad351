"""The device-schedule path: a call on device (CUDA) buffers that no board path takes runs its
schedule with ``device_engine``, chunks pipelined on CUDA streams through pinned slots (or
straight to and from device memory over links that take it), each GPU's streams and slots made
once and kept."""

from __future__ import annotations

import logging

from ddlcore import device, device_ops
from ddlcore.algorithms import Buf
from ddlcore.buffers import MemoryKind
from ddlcore.calls import Call
from ddlcore.execution import device_engine, engine
from ddlcore.execution.check_words import describe_check
from ddlcore.execution.paths.base import Context, PathBase, Plan, board_mode, check_word, label
from ddlcore.execution.paths.schedule import schedules

log = logging.getLogger("ddlcore")

NAME = "device"


class DevicePath(PathBase):
    """Calls on device buffers, as schedules on CUDA streams."""

    name = NAME

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.chunk_bytes = ctx.device_chunk_bytes or ctx.chunk_bytes
        self.schedule = schedules(ctx, self.chunk_bytes)
        self.slots: dict[int, device_ops.DeviceSlots] = {}  # by GPU

    def plan(self, call: Call) -> Plan | None:
        if call.inp is None or call.inp.memory != MemoryKind.CUDA:
            return None
        itemsize = call.inp.dtype.itemsize
        moved = max((d.nbytes for d in (call.inp, call.out) if d is not None), default=0)
        if moved <= self.chunk_bytes:
            # One chunk has nothing to pipeline: staged whole by the schedule path (one
            # download, the host schedule, one upload) it skips the engine's fixed cost of
            # streams, events and Numba calls (H100: 1 MiB allreduce 0.7 ms staged, 2.1 ms here).
            return None
        return Plan(itemsize, board_mode(self.ctx, call, itemsize))

    def _run(self, plan: Plan, call: Call, seq: int) -> None:
        assert call.inp is not None and call.out is not None
        self.agree_first(plan, call, seq)
        ctx, itemsize = self.ctx, plan.itemsize
        name = label(call, seq)
        choice, sched = self.schedule(call.collective, call.count, itemsize, call.root, call.splits)
        if ctx.debug:
            peers = sorted({st.peer for st in sched.steps if st.peer >= 0})
            direct = [
                p
                for p in peers
                if ctx.links is not None and getattr(ctx.links.pair(p), "device_memory", False)
            ]
            how = (
                "device memory straight to and from " + ", ".join(f"rank {p}" for p in direct)
                if direct
                else "through pinned host slots"
            )
            if direct and len(direct) < len(peers):
                how += ", the others through pinned host slots"
            log.debug(
                "rank %d: %s via %s on CUDA streams (%s), box %s, %d steps, %d messages out",
                ctx.rank,
                name,
                choice.describe(),
                how,
                ctx.topology.shape,
                len(sched.steps),
                sched.messages(),
            )
        # The executor's thread has no current CUDA context: streams, slots and kernels must be
        # on the buffers' GPU, not on whichever Numba would make current (GPU 0).
        with device.on_device(call.inp.device):
            slots = self._slots(call.inp.device)
            buffers = {
                Buf.INPUT: device.region_of(call.inp.array),
                Buf.OUTPUT: device.region_of(call.out.array),
            }
            if sched.scratch_count:
                buffers[Buf.SCRATCH] = slots.scratch(sched.scratch_count * itemsize)
            coll = engine.Collective(
                seq & 0x7FFFFFFF,
                check_word(call, chunk_bytes=choice.chunk_bytes),
                itemsize,
                int(call.inp.code),
                call.op,
                name,
                lambda check, nbytes: describe_check(
                    check, call, ctx.size, choice.chunk_bytes, nbytes
                ),
            )
            device_engine.run(
                sched, coll, buffers, ctx.links, slots, ctx.depth, ctx.timeout, call.ready
            )

    def _slots(self, device_id: int) -> device_ops.DeviceSlots:
        """Streams and staging slots of GPU ``device_id`` (made in its context)."""
        slots = self.slots.get(device_id)
        if slots is None:
            slots = self.slots[device_id] = device_ops.DeviceSlots(device.NumbaStreams())
        return slots

    def close(self) -> None:
        self.schedule.cache_clear()
