"""One collective call, checked and described before any communication: the buffers'
descriptors (the output allocated when the caller passed none), the op, the root, and for device
buffers an event on the caller's stream. Bad arguments raise ValueError/TypeError naming the
argument; nothing here talks to another rank."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddlcore import device
from ddlcore.buffers import BufferDesc, MemoryKind, as_buffer, empty_like
from ddlcore.collectives import Collective
from ddlcore.kernels.dtypes import DType, numpy_dtype
from ddlcore.ops import Op, as_op

COLLECTIVES = tuple(Collective)  # in fingerprint order
_FINGERPRINT = struct.Struct("<4sBBBxiq")  # magic, collective, dtype, op, root, count
_FINGERPRINT_MAGIC = b"DDLa"
_NONE = 255  # no dtype (barrier), no op


@dataclass
class Call:
    """One validated collective call."""

    collective: Collective
    inp: BufferDesc | None
    out: BufferDesc | None
    op: Op | None = None
    root: int = 0
    result: Any = None
    ready: Any = None  # device buffers: an event on the caller's stream, recorded at the call
    count: int = 0  # the input's elements (a field, not a property: read several times a call)


def output(x: BufferDesc, out: Any, shape: tuple[int, ...]) -> tuple[BufferDesc, Any]:
    """The output's descriptor and the object returned to the caller: ``out`` checked against
    ``x`` (same memory and device, dtype, ``shape``'s element count, writable), or new."""
    if out is None:
        desc = empty_like(x, shape)
        return desc, desc.wrap(desc.array)
    desc = as_buffer(out, "out")
    if (desc.memory, desc.device) != (x.memory, x.device):
        raise ValueError(
            f"out is in {desc.memory.value} memory (device {desc.device}) but x is "
            f"in {x.memory.value} memory (device {x.device}); pass both on the "
            "same device"
        )
    if desc.dtype != x.dtype:
        raise TypeError(f"out has dtype {desc.dtype} but x has {x.dtype}")
    expected = math.prod(shape)
    if desc.count != expected:
        raise ValueError(f"out has {desc.count} elements, expected {expected} (shape {shape})")
    if desc.readonly:
        raise ValueError("out is read-only")
    return desc, out


def prepare(collective: Collective, x: Any, op: Any, out: Any, root: int, size: int) -> Call:
    """Check the arguments of ``collective`` on a communicator of ``size`` ranks and describe
    its buffers (the output allocated when ``out`` is None). Raises ValueError/TypeError naming
    the argument."""
    collective = Collective(collective)
    if collective == Collective.BARRIER:
        return Call(collective, None, None)
    rop = as_op(op) if op is not None else None
    xd = as_buffer(x, "x")
    if collective == Collective.ALLREDUCE:
        od, result = output(xd, out, xd.shape)
    elif collective == Collective.REDUCE_SCATTER:
        if xd.count % size:
            raise ValueError(
                f"x has {xd.count} elements, not divisible by the communicator "
                f"size {size}; reduce_scatter needs size * k elements"
            )
        shape = xd.shape
        if len(shape) >= 1 and shape[0] % size == 0:
            out_shape = (shape[0] // size, *shape[1:])
        else:
            out_shape = (xd.count // size,)
        od, result = output(xd, out, out_shape)
    elif collective == Collective.ALLGATHER:
        out_shape = (size * xd.shape[0], *xd.shape[1:]) if xd.shape else (size,)
        od, result = output(xd, out, out_shape)
    elif collective == Collective.BROADCAST:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"root must be an int, not {type(root).__name__}")
        if not 0 <= root < size:
            raise ValueError(f"root={root} is not a rank of this communicator (size {size})")
        if xd.readonly:
            raise ValueError("x is read-only; broadcast writes the root's data into it")
        od, result = xd, x
    else:  # pragma: no cover - internal misuse
        raise AssertionError(collective)
    ready = device.ready_event(x, out) if xd.memory == MemoryKind.CUDA else None
    return Call(collective, xd, od, rop, int(root), result, ready, xd.count)


def fingerprint(call: Call) -> bytes:
    """The call's collective, dtype, op, root and element count in 20 bytes: what ranks compare
    where their messages carry no check word (`engine.agree`)."""
    return _FINGERPRINT.pack(
        _FINGERPRINT_MAGIC,
        COLLECTIVES.index(call.collective),
        int(call.inp.code) if call.inp is not None else _NONE,
        int(call.op) if call.op is not None else _NONE,
        call.root,
        call.count,
    )


def describe_fingerprint(raw: bytes) -> str:
    """A `fingerprint` as the call it describes, e.g. "broadcast(1000 x float32, root 1)"."""
    if len(raw) != _FINGERPRINT.size:
        return f"something else ({len(raw)} bytes, not a call's description)"
    magic, kind, code, op, root, count = _FINGERPRINT.unpack(raw)
    if magic != _FINGERPRINT_MAGIC or kind >= len(COLLECTIVES):
        return "something else (not a call's description)"
    name = COLLECTIVES[kind]
    if name == Collective.BARRIER:
        return "barrier()"
    try:
        desc = f"{count} x {numpy_dtype(DType(code)).name}"
    except (ValueError, KeyError):
        desc = f"{count} x dtype {code}"
    if op != _NONE:
        try:
            desc += f", {Op(op).name.lower()}"
        except ValueError:
            desc += f", op {op}"
    if name == Collective.BROADCAST:
        desc += f", root {root}"
    return f"{name}({desc})"
