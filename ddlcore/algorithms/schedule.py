"""Schedules: a collective as plain data, an ordered list of point-to-point steps.

An algorithm module turns (collective, size, rank, count, chunking) into a `Schedule`. The engine
executes it over transports and kernels; the simulator replays it against a link model; tests check
it symbolically. Nothing in a schedule names a transport, a framework or a memory kind.

Step vocabulary (after NCCL's primitives; composite ones are two consecutive steps):

* ``SEND``        -- send ``count`` elements of ``src`` at ``src_off`` to ``peer``.
* ``RECV``        -- receive ``count`` elements from ``peer`` straight into ``dst`` at ``dst_off``.
* ``RECV_REDUCE`` -- receive into a staging slot, then ``dst[dst_off:] = src[src_off:] OP staged``
  (a fused reduce-copy; ``src`` and ``dst`` may be the same region). ``finalize`` marks the last
  reduction of a region: the engine applies avg's division there, so every rank ends up with
  bit-identical values. ``staged_first`` swaps the operands (``staged OP src``): algorithms in
  which two ranks compute the same combination (recursive doubling) put the lower rank's data
  first on both, so even min/max of signed zeros agree bit for bit.
* ``COPY``        -- local copy of ``count`` elements from ``src`` to ``dst``.

Buffers are named by role: ``INPUT`` (the caller's data, never written), ``OUTPUT`` (the result),
``SCRATCH`` (engine-owned, sized by `Schedule.scratch_count`). Offsets and counts are in elements.
Every message has a ``slot``, unique per collective for its (sender, receiver) pair; the engine
builds the transport tag from the collective's sequence number and the slot, so the matching
``SEND`` on one rank and ``RECV*`` on the other carry the same slot.

Streams. A schedule may be cut into ``parts`` (`Part`): each step names its part, each part a
``stream`` and the parts it runs ``after``. Steps of one stream run in program order; parts of
different streams run concurrently once their ``after`` parts have finished (every step done,
every send complete), as CUDA streams with events do. The multi-dimensional ring uses this to
pipeline segments across box dimensions (one stream per dimension: segment s on the network
while segment s+1 is on the host links). The steps' own order is always a valid serial order
(every part after the parts it waits for, the same interleaving on every rank), so an engine
may also run them one by one. A schedule without parts is one stream.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from ddlcore.transports.base import STEP_COLUMNS


class Kind(enum.IntEnum):
    SEND = 0
    RECV = 1
    RECV_REDUCE = 2
    COPY = 3


class Buf(enum.IntEnum):
    INPUT = 0
    OUTPUT = 1
    SCRATCH = 2


@dataclass(frozen=True, slots=True)
class Step:
    kind: Kind
    peer: int
    slot: int
    count: int
    src: Buf = Buf.INPUT
    src_off: int = 0
    dst: Buf = Buf.OUTPUT
    dst_off: int = 0
    finalize: bool = False
    staged_first: bool = False
    part: int = 0  # index into `Schedule.parts` (0 where the schedule has none)

    def with_slot(self, slot: int) -> Step:
        """This step on message slot ``slot``: ``dataclasses.replace(self, slot=slot)`` at half
        its cost (schedules of thousands of steps are renumbered as they are planned)."""
        return Step(
            self.kind,
            self.peer,
            slot,
            self.count,
            self.src,
            self.src_off,
            self.dst,
            self.dst_off,
            self.finalize,
            self.staged_first,
            self.part,
        )

    def describe(self) -> str:
        if self.kind == Kind.SEND:
            return f"send      {self.src.name}[{self.src_off}:+{self.count}] -> rank {self.peer} (slot {self.slot})"
        if self.kind == Kind.RECV:
            return f"recv      rank {self.peer} -> {self.dst.name}[{self.dst_off}:+{self.count}] (slot {self.slot})"
        if self.kind == Kind.RECV_REDUCE:
            fin = (" final" if self.finalize else "") + (
                " (staged first)" if self.staged_first else ""
            )
            return (
                f"recv-red  rank {self.peer} (+) {self.src.name}[{self.src_off}:+{self.count}] -> "
                f"{self.dst.name}[{self.dst_off}]{fin} (slot {self.slot})"
            )
        return f"copy      {self.src.name}[{self.src_off}:+{self.count}] -> {self.dst.name}[{self.dst_off}]"


@dataclass(frozen=True, slots=True)
class Part:
    """A run of steps on one stream, started once the parts ``after`` have finished."""

    stream: int
    after: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """One rank's part of one collective."""

    collective: str
    algorithm: str
    rank: int
    size: int
    count: int  # elements of the collective's input on this rank
    chunk_count: int  # elements per pipeline chunk
    steps: tuple[Step, ...]
    scratch_count: int = 0
    parts: tuple[Part, ...] = ()  # empty: one stream, the steps in order

    def messages(self) -> int:
        return sum(1 for s in self.steps if s.kind == Kind.SEND)

    @functools.cached_property
    def part_steps(self) -> tuple[tuple[tuple[int, ...], tuple[Step, ...]], ...]:
        """Each part's steps in program order, with their indices in ``steps``."""
        index: list[list[int]] = [[] for _ in self.parts or (None,)]
        for i, s in enumerate(self.steps):
            index[s.part].append(i)
        return tuple((tuple(ix), tuple(self.steps[i] for i in ix)) for ix in index)

    @functools.cached_property
    def table(self) -> StepTable:
        """The steps as one integer array, for native executors (`StepTable`)."""
        return StepTable.of(self.steps)

    def streams(self) -> dict[int, list[int]]:
        """Each stream's parts in the order it runs them (the first part's stream first); a
        schedule without parts is part 0 on stream 0."""
        if not self.parts:
            return {0: [0]}
        out: dict[int, list[int]] = {}
        for p, part in enumerate(self.parts):
            out.setdefault(part.stream, []).append(p)
        return out

    def __str__(self) -> str:
        head = (
            f"{self.collective} via {self.algorithm}: rank {self.rank}/{self.size}, "
            f"{self.count} elements, chunks of {self.chunk_count}, {len(self.steps)} steps"
        )
        if not self.parts:
            return "\n".join(
                [head] + [f"  {i:4d} {s.describe()}" for i, s in enumerate(self.steps)]
            )
        lines = [head + f" in {len(self.parts)} parts on {len(self.streams())} streams"]
        for i, s in enumerate(self.steps):
            part = self.parts[s.part]
            after = f" after {','.join(map(str, part.after))}" if part.after else ""
            lines.append(f"  {i:4d} [part {s.part} stream {part.stream}{after}] {s.describe()}")
        return "\n".join(lines)


@dataclass(frozen=True)
class StepTable:
    """A schedule's steps as an int64 array with one row per step, columns as the transports
    take them (``transports.base.STEP_COLUMNS``; flags: 1 finalize, 2 staged first), for
    executors written in C; ``max_count`` and ``max_reduced``: the largest step's element
    count, and the largest ``RECV_REDUCE``'s."""

    rows: np.ndarray
    max_count: int
    max_reduced: int

    @classmethod
    def of(cls, steps: tuple[Step, ...]) -> StepTable:
        rows = np.array(
            [
                (
                    s.kind,
                    s.peer,
                    s.slot,
                    s.count,
                    s.src,
                    s.src_off,
                    s.dst,
                    s.dst_off,
                    int(s.finalize) | int(s.staged_first) << 1,
                )
                for s in steps
            ],
            dtype=np.int64,
        ).reshape(len(steps), len(STEP_COLUMNS))
        rows.flags.writeable = False
        reduced = [s.count for s in steps if s.kind == Kind.RECV_REDUCE]
        return cls(rows, max((s.count for s in steps), default=0), max(reduced, default=0))


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """Split ``count`` elements into ``parts`` contiguous (offset, length) pieces, the first
    ``count % parts`` of them one element longer; every rank computes the same split."""
    base, extra = divmod(count, parts)
    out, off = [], 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((off, length))
        off += length
    return out


def chunks_of(offset: int, length: int, nchunks: int) -> list[tuple[int, int]]:
    """Chunk ``c`` of a segment: a proportional slice, so segments of unequal length still have
    the same number of chunks (some may be empty)."""
    return [
        (offset + length * c // nchunks, length * (c + 1) // nchunks - length * c // nchunks)
        for c in range(nchunks)
    ]


def nchunks_for(longest: int, chunk_count: int) -> int:
    return max(1, -(-longest // max(1, chunk_count)))


def drop_empty(steps: Iterable[Step]) -> tuple[Step, ...]:
    """Remove zero-length data steps, then number each pair's messages 0, 1, 2 ... in slot order.

    Both ends of a message see the same lengths, so they drop the same messages; and the slots a
    rank sends to a peer are the slots that peer receives from it, so both ends renumber alike.
    Starting every pair at slot 0 makes the first messages of two DIFFERENT collectives collide
    on the same tag, where the transports compare the check words and report the mismatch,
    instead of each waiting for a tag the other never sends."""
    copy, send = Kind.COPY, Kind.SEND  # hoisted: planning runs this over thousands of steps
    kept = [s for s in steps if s.count > 0]
    slots: dict[tuple[bool, int], set[int]] = {}
    for s in kept:
        if s.kind is not copy:
            key = (s.kind is send, s.peer)
            used = slots.get(key)
            if used is None:
                slots[key] = used = set()
            used.add(s.slot)
    number: dict[tuple[bool, int], dict[int, int]] = {}
    for key, used in slots.items():
        ordered = sorted(used)
        if ordered[0] != 0 or ordered[-1] != len(ordered) - 1:  # distinct: else 0, 1, ... already
            number[key] = {slot: i for i, slot in enumerate(ordered)}
    if not number:
        return tuple(kept)
    out = []
    for s in kept:
        if s.kind is not copy:
            renumber = number.get((s.kind is send, s.peer))
            if renumber is not None:
                s = s.with_slot(renumber[s.slot])
        out.append(s)
    return tuple(out)
