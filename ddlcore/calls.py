"""One collective call, checked and described before any communication: the buffers'
descriptors (the output allocated when the caller passed none), the op (on bool buffers, the one
`ops.logical` picks), the root, and for device buffers an event on the caller's stream. Bad
arguments raise ValueError/TypeError naming the argument; nothing here talks to another rank.
How ranks compare calls is described here too: `fingerprint`, and `describe_call`, the words
every mismatch message uses (`ddlcore.execution.check_words` finds another rank's call from
the check word its message carried)."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddlcore import device
from ddlcore.buffers import BufferDesc, MemoryKind, as_buffer, empty_like
from ddlcore.collectives import HAS_ROOT, Collective
from ddlcore.kernels.dtypes import DType, dtype_name
from ddlcore.ops import Op, as_op, logical

COLLECTIVES = tuple(Collective)  # in fingerprint order
# The collectives with a root besides broadcast (its result on one rank, or from one rank).
ROOTED = (Collective.REDUCE, Collective.GATHER, Collective.SCATTER)
_FINGERPRINT = struct.Struct("<4sBBBxiq")  # magic, collective, dtype, op, root, count
_FINGERPRINT_MAGIC = b"DDLa"
NONE_CODE = 255  # no dtype (barrier), no op: in fingerprints and check words


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
    # The elements every rank agrees on (a field, not a property: read several times a call):
    # the input's, but scatter's block per rank and 0 for alltoallv (see `prepare_rooted`).
    count: int = 0
    splits: tuple[tuple[int, ...], tuple[int, ...]] | None = None  # alltoallv's (send, recv)


def output(
    x: BufferDesc, out: Any, shape: tuple[int, ...], x_obj: Any = None
) -> tuple[BufferDesc, Any]:
    """The output's descriptor and the object returned to the caller: ``out`` checked against
    ``x`` (same memory and device, dtype, ``shape``'s element count, writable), or new.
    ``x_obj``: the object ``x`` describes (in place, ``out is x_obj``: described once)."""
    if out is None:
        desc = empty_like(x, shape)
        return desc, desc.wrap(desc.array)
    desc = x if out is x_obj else as_buffer(out, "out")
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


def check_root(root: Any, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
        raise TypeError(f"root must be an int, not {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"root={root} is not a rank of this communicator (size {size})")
    return int(root)


def split_shape(xd: BufferDesc, size: int, name: str, collective: str) -> tuple[int, ...]:
    """The shape of one of ``size`` blocks of ``xd`` (size * k elements, else ValueError): split
    along the first dimension where it divides by size, else 1-D."""
    if xd.count % size:
        raise ValueError(
            f"{name} has {xd.count} elements, not divisible by the communicator "
            f"size {size}; {collective} needs size * k elements"
        )
    shape = xd.shape
    if len(shape) >= 1 and shape[0] % size == 0:
        return (shape[0] // size, *shape[1:])
    return (xd.count // size,)


def prepare(
    collective: Collective,
    x: Any,
    op: Any,
    out: Any,
    root: int,
    size: int,
    rank: int = 0,
    splits: Any = None,
) -> Call:
    """Check the arguments of ``collective`` on a communicator of ``size`` ranks (this one
    ``rank``: the rooted collectives' buffers depend on it) and describe its buffers (the
    output allocated when ``out`` is None). ``splits``: alltoallv's (send, recv) counts.
    Raises ValueError/TypeError naming the argument."""
    collective = Collective(collective)
    if collective == Collective.BARRIER:
        return Call(collective, None, None)
    if collective in ROOTED or collective in (Collective.ALLTOALL, Collective.ALLTOALLV):
        return prepare_rooted(collective, x, op, out, root, size, rank, splits)
    rop = as_op(op) if op is not None else None
    xd = as_buffer(x, "x")
    if rop is not None and xd.logical:
        rop = logical(rop)
    if collective == Collective.ALLREDUCE:
        od, result = output(xd, out, xd.shape, x)
    elif collective == Collective.REDUCE_SCATTER:
        od, result = output(xd, out, split_shape(xd, size, "x", collective))
    elif collective == Collective.ALLGATHER:
        out_shape = (size * xd.shape[0], *xd.shape[1:]) if xd.shape else (size,)
        od, result = output(xd, out, out_shape)
    elif collective == Collective.BROADCAST:
        check_root(root, size)
        if xd.readonly:
            raise ValueError("x is read-only; broadcast writes the root's data into it")
        od, result = xd, x
    else:  # pragma: no cover - internal misuse
        raise AssertionError(collective)
    ready = device.ready_event(x, out) if xd.memory == MemoryKind.CUDA else None
    return Call(collective, xd, od, rop, int(root), result, ready, xd.count)


def prepare_rooted(
    collective: Collective,
    x: Any,
    op: Any,
    out: Any,
    root: Any,
    size: int,
    rank: int,
    splits: Any,
) -> Call:
    """`prepare` for reduce, gather, scatter, alltoall and alltoallv.

    A non-root's reduce and gather have no output (the result is None; an ``out`` given is
    checked, never written); its descriptor there is the input's, which the schedules never
    write. A non-root's scatter reads no input: ``x`` may be None when ``out`` is given (else
    ``x`` only gives the output's shape and dtype, as on the root)."""
    rop = as_op(op) if op is not None else None
    if collective in ROOTED:
        root = check_root(root, size)
    at_root = rank == root
    if collective == Collective.SCATTER and x is None:
        if at_root:
            raise ValueError(f"x is None on the root (rank {rank}); scatter sends root's x")
        if out is None:
            raise ValueError(
                f"rank {rank}: scatter needs x (size * k elements, for its shape and dtype) "
                "or out= (k elements, the destination) on a non-root rank"
            )
        od = as_buffer(out, "out")
        if od.readonly:
            raise ValueError("out is read-only")
        return _call(collective, od, od, rop, root, out, out, od.count)
    xd = as_buffer(x, "x")
    if rop is not None and xd.logical:
        rop = logical(rop)
    count, result = xd.count, None
    if collective == Collective.REDUCE:
        od, result = output(xd, out, xd.shape) if at_root or out is not None else (xd, None)
    elif collective == Collective.GATHER:
        shape = (size * xd.shape[0], *xd.shape[1:]) if xd.shape else (size,)
        od, result = output(xd, out, shape) if at_root or out is not None else (xd, None)
    elif collective == Collective.SCATTER:
        od, result = output(xd, out, split_shape(xd, size, "x", collective))
        count = od.count
    elif collective == Collective.ALLTOALL:
        split_shape(xd, size, "x", collective)
        od, result = output(xd, out, xd.shape)
    else:
        send, recv = splits
        if sum(send) != xd.count:
            raise ValueError(
                f"send_counts add up to {sum(send)} elements but x has {xd.count}; "
                "alltoallv sends x's elements in rank order"
            )
        od, result = output(xd, out, (sum(recv),))
        count = 0  # each rank's own: the messages' lengths compare them
    if not at_root and collective in (Collective.REDUCE, Collective.GATHER):
        od, result = xd, None  # an out= given is left untouched
    elif (
        collective in (Collective.SCATTER, Collective.ALLTOALL, Collective.ALLTOALLV)
        and (at_root or collective != Collective.SCATTER)
        and od.nbytes
        and od.ptr < xd.ptr + xd.nbytes
        and xd.ptr < od.ptr + od.nbytes
    ):  # blocks arrive where blocks still to be sent are
        raise ValueError(f"out overlaps x; {collective} cannot run in place: pass another out")
    return _call(collective, xd, od, rop, root, x, result, count, splits)


def _call(
    collective: Collective,
    xd: BufferDesc,
    od: BufferDesc,
    op: Op | None,
    root: int,
    x: Any,
    result: Any,
    count: int,
    splits: Any = None,
) -> Call:
    ready = device.ready_event(x, result) if xd.memory == MemoryKind.CUDA else None
    return Call(collective, xd, od, op, root, result, ready, count, splits)


def as_allreduce(call: Call) -> Call:
    """An integer avg reduce as the allreduce that computes it exactly (`int_avg`), into the
    root's output, or a buffer of its own on the others (their result stays None)."""
    assert call.inp is not None and call.out is not None
    out = call.out
    if call.result is None:  # a non-root: the schedules never wrote its placeholder output
        out = empty_like(call.inp, call.inp.shape)
    return Call(
        Collective.ALLREDUCE, call.inp, out, call.op, 0, call.result, call.ready, call.count
    )


def check_splits(counts: Any, size: int, name: str) -> tuple[int, ...]:
    """alltoallv's ``counts`` (one non-negative int per rank) as a tuple."""
    try:
        out = tuple(int(c) for c in counts)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of {size} ints") from None
    if len(out) != size or any(c < 0 for c in out):
        raise ValueError(f"{name} must hold {size} non-negative counts (one per rank), got {out}")
    return out


def fingerprint(call: Call) -> bytes:
    """The call's collective, dtype, op, root and element count in 20 bytes: what ranks compare
    where their messages carry no check word (`engine.agree`)."""
    return _FINGERPRINT.pack(
        _FINGERPRINT_MAGIC,
        COLLECTIVES.index(call.collective),
        call.inp.check_code if call.inp is not None else NONE_CODE,
        int(call.op) if call.op is not None else NONE_CODE,
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
    return describe_call(name, code, op, root, count)


def op_name(op: int) -> str:
    """The name of an op code ("sum"), for messages; "op code N" for a number that is none."""
    try:
        return Op(op).name.lower()
    except ValueError:
        return f"op code {op}"


def describe_call(name: Collective, code: int, op: int, root: int, count: int) -> str:
    """A call as messages name it, from its codes (a dtype code or `BOOL_CODE`, an op code or
    255 for none): "allreduce(1000 x float32, sum)", "broadcast(7 x bool, root 1)"; an
    integer avg's wide sum as the avg it computes (`int_avg.marker`)."""
    if name == Collective.BARRIER:
        return "barrier()"
    if op < 0:  # DDL_DEBUG's rows: -1 for none
        op = NONE_CODE
    if root < 0 and op == Op.SUM and -1 - root in NAMED_CODES:  # int_avg's wide sum
        return f"{name}({count} x {dtype_name(-1 - root)}, avg)"
    desc = f"{count} x {dtype_name(code)}"
    if op != NONE_CODE:
        desc += f", {op_name(op)}"
    if name in HAS_ROOT:
        desc += f", root {root}"
    return f"{name}({desc})"


NAMED_CODES = frozenset(int(code) for code in DType)  # the dtypes a check word can name
