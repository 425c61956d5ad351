"""Recursive halving-doubling (``rhd``, Rabenseifner) and recursive doubling (``rd``), any P.

P' is the largest power of two <= P and r = P - P'. The first 2r ranks pair up (fold): each even
rank hands its data to the odd rank after it and sits out; the odd ones and the ranks from 2r on
are the P' "virtual" ranks v = 0 .. P'-1. At the end the odd ranks hand the result back (unfold).

rhd allreduce of n elements (virtual ranks; a rank's half is kept, the other half given away)::

    fold:      even 2i -> odd 2i+1: n (reduced there)                  [only when P is not 2^k]
    halving:   v <-> v ^ 1: exchange n/2, reduce the kept half;  v <-> v ^ 2: n/4 ... P'/2
    doubling:  v <-> v ^ P'/2: exchange the owned n/P';  ... v <-> v ^ 1: n/2
    unfold:    odd 2i+1 -> even 2i: n

Nearest partners first: with ranks placed host by host the big halves stay inside a host, and
the network carries n/L per rank for L ranks per host (the bytes of the multi-dimensional ring).
Partners are rank numbers, not box positions: with ranks dealt round-robin over the hosts the
big halves cross the network (the cost model prices that; mdring follows the hosts instead).

2 log2 P' latency steps and 2 (P'-1)/P' n elements per rank (+2n on folded pairs): fewer steps
than the ring for mid-sized messages. Each element is reduced once (by its owner), so the result
is identical on every rank. Reduce-scatter is the fold and halving (virtual rank v owns the
blocks of the ranks it stands for, kept in rank order, so halving with the LARGEST distance first
leaves every rank its own block); allgather is doubling from distance 1 and the unfold.

rd allreduce exchanges the whole vector at every distance 1, 2, ..., P'/2 and reduces on both
sides: log2 P' (+2) steps, the latency optimum for small messages. Both partners compute the same
combination with the lower virtual rank's data first (``staged_first``), so results stay
bit-identical on every rank.
"""

from __future__ import annotations

from ddlcore.algorithms.ring import chunk_elems, local_copy
from ddlcore.algorithms.schedule import (
    Buf,
    Kind,
    Schedule,
    Step,
    chunks_of,
    drop_empty,
    nchunks_for,
    split,
)
from ddlcore.collectives import Collective
from ddlcore.topology import Topology

NAME = "rhd"
RD_NAME = "rd"

Piece = tuple[int, int, int]  # (offset, count, rank whose block it belongs to, or -1)


def virtual_shape(size: int) -> tuple[int, int]:
    """(P', r): the largest power of two <= P, and how many ranks fold away."""
    p2 = 1 << (size.bit_length() - 1)
    return p2, size - p2


class _Fold:
    """Virtual ranks of P ranks, and the element pieces each virtual rank stands for."""

    def __init__(self, rank: int, size: int, units: list[list[tuple[int, int, int]]], chunk: int):
        self.p2, self.extra = virtual_shape(size)
        self.rounds = self.p2.bit_length() - 1
        self.rank = rank
        if rank < 2 * self.extra:
            self.v = rank // 2 if rank % 2 else -1  # -1: folded away (hands data to rank + 1)
        else:
            self.v = rank - self.extra
        self._pieces = [
            [
                (o + off, n, owner)
                for off, length, owner in blocks
                for o, n in chunks_of(0, length, nchunks_for(length, chunk))
            ]
            for blocks in units
        ]
        self.stride = sum(len(p) for p in self._pieces) + 1

    def real(self, v: int) -> int:
        return 2 * v + 1 if v < self.extra else v + self.extra

    @property
    def folds(self) -> bool:
        """Whether this (odd) rank stands for the even rank before it too."""
        return self.rank < 2 * self.extra

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        return [p for v in range(lo, hi) for p in self._pieces[v]]

    def sends(
        self, pieces: list[Piece], peer: int, phase: int, src: Buf, shift: int = 0
    ) -> list[Step]:
        base = phase * self.stride
        return [
            Step(Kind.SEND, peer, base + i, n, src, off - shift)
            for i, (off, n, _) in enumerate(pieces)
        ]

    def recvs(
        self, pieces: list[Piece], peer: int, phase: int, dst: Buf, shift: int = 0
    ) -> list[Step]:
        base = phase * self.stride
        return [
            Step(Kind.RECV, peer, base + i, n, dst=dst, dst_off=off - shift)
            for i, (off, n, _) in enumerate(pieces)
        ]


def _units_even(count: int, parts: int) -> list[list[tuple[int, int, int]]]:
    return [[(off, n, -1)] for off, n in split(count, parts)]


def _units_blocks(size: int, k: int) -> list[list[tuple[int, int, int]]]:
    """Virtual rank v's blocks of k elements: its own rank's, and the folded rank's before it."""
    p2, extra = virtual_shape(size)
    out = []
    for v in range(p2):
        ranks = [2 * v, 2 * v + 1] if v < extra else [v + extra]
        out.append([(r * k, k, r) for r in ranks])
    return out


def _distances(p2: int, nearest_first: bool) -> list[int]:
    out = [1 << i for i in range(p2.bit_length() - 1)]
    return out if nearest_first else out[::-1]


def _halving(
    fold: _Fold, src: Buf, work: Buf, final_dst, first_phase: int, nearest_first: bool = False
) -> tuple[list[Step], int, list]:
    """Recursive halving; returns the steps, the phase after, and each round's (kept range,
    given range, peer) for `_undo_halving`. Partial reductions go to ``work`` at their own
    offsets; the last round's to ``final_dst(piece)`` = (buffer, offset).

    The range a rank keeps is the half its bit of the round's distance points to. Largest
    distance first leaves virtual rank v the slot v (reduce-scatter needs that); nearest first
    leaves it the bit-reversed slot, but moves the big halves between near ranks (same host,
    with ranks placed host by host), which is what allreduce uses."""
    steps: list[Step] = []
    rounds = []
    lo, hi, phase = 0, fold.p2, first_phase
    v = fold.v
    distances = _distances(fold.p2, nearest_first)
    for d in distances:
        mid = (lo + hi) // 2
        keep, give = ((mid, hi), (lo, mid)) if v & d else ((lo, mid), (mid, hi))
        peer = fold.real(v ^ d)
        last = d == distances[-1]
        steps += fold.sends(fold.pieces(*give), peer, phase, src)
        base = phase * fold.stride
        for i, piece in enumerate(fold.pieces(*keep)):
            off, n, _ = piece
            buf, at = final_dst(piece) if last else (work, off)
            steps.append(
                Step(Kind.RECV_REDUCE, peer, base + i, n, src, off, buf, at, finalize=last)
            )
        rounds.append((keep, give, peer))
        src = work  # later rounds reduce what this one wrote
        lo, hi, phase = keep[0], keep[1], phase + 1
    return steps, phase, rounds


def _undo_halving(fold: _Fold, rounds: list, buf: Buf, first_phase: int) -> list[Step]:
    """The allgather that mirrors a halving: its rounds in reverse, each sending the range this
    rank completed within the round's kept half and receiving the half it gave away."""
    steps: list[Step] = []
    phase = first_phase
    for keep, give, peer in reversed(rounds):
        steps += fold.sends(fold.pieces(*keep), peer, phase, buf)
        steps += fold.recvs(fold.pieces(*give), peer, phase, buf)
        phase += 1
    return steps


def _doubling(fold: _Fold, buf: Buf, first_phase: int) -> tuple[list[Step], int]:
    """Recursive doubling of owned ranges from distance 1 up to P'/2, in place in ``buf``."""
    steps: list[Step] = []
    d, phase, v = 1, first_phase, fold.v
    while d < fold.p2:
        mine, theirs = v & ~(d - 1), (v ^ d) & ~(d - 1)
        peer = fold.real(v ^ d)
        steps += fold.sends(fold.pieces(mine, mine + d), peer, phase, buf)
        steps += fold.recvs(fold.pieces(theirs, theirs + d), peer, phase, buf)
        d, phase = d * 2, phase + 1
    return steps, phase


def allreduce(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(Collective.ALLREDUCE, rank, count, chunk, algorithm=NAME)
    fold = _Fold(rank, size, _units_even(count, virtual_shape(size)[0]), chunk)
    everything = fold.pieces(0, fold.p2)
    unfold_phase = 2 * fold.rounds + 1
    if fold.v < 0:
        steps = _folded_away(fold, everything, unfold_phase)
        return Schedule(Collective.ALLREDUCE, NAME, rank, size, count, chunk, drop_empty(steps))
    steps = []
    src = Buf.INPUT
    if fold.folds:
        steps += _recv_reduce_all(fold, everything, rank - 1, Buf.INPUT, Buf.OUTPUT)
        src = Buf.OUTPUT
    halving, phase, rounds = _halving(
        fold, src, Buf.OUTPUT, lambda piece: (Buf.OUTPUT, piece[0]), 1, nearest_first=True
    )
    steps += halving + _undo_halving(fold, rounds, Buf.OUTPUT, phase)
    if fold.folds:
        steps += fold.sends(everything, rank - 1, unfold_phase, Buf.OUTPUT)
    return Schedule(Collective.ALLREDUCE, NAME, rank, size, count, chunk, drop_empty(steps))


def reduce_scatter(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """``count`` = size * k; rank r ends with the reduced block r."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(Collective.REDUCE_SCATTER, rank, count, chunk, algorithm=NAME)
    k = count // size
    fold = _Fold(rank, size, _units_blocks(size, k), chunk)
    everything = fold.pieces(0, fold.p2)
    unfold_phase = fold.rounds + 1
    if fold.v < 0:
        steps = fold.sends(everything, rank + 1, 0, Buf.INPUT)
        steps += fold.recvs(_own(fold, rank), rank + 1, unfold_phase, Buf.OUTPUT, rank * k)
        return Schedule(
            Collective.REDUCE_SCATTER, NAME, rank, size, count, chunk, drop_empty(steps)
        )
    steps = []
    src = Buf.INPUT
    if fold.folds:
        steps += _recv_reduce_all(fold, everything, rank - 1, Buf.INPUT, Buf.SCRATCH)
        src = Buf.SCRATCH

    def final_dst(piece: Piece) -> tuple[Buf, int]:
        if piece[2] == rank:
            return Buf.OUTPUT, piece[0] - rank * k
        return Buf.SCRATCH, piece[0]  # the folded rank's block, sent on below

    halving, _, _ = _halving(fold, src, Buf.SCRATCH, final_dst, 1)
    steps += halving
    if fold.folds:
        steps += fold.sends(_own(fold, rank - 1), rank - 1, unfold_phase, Buf.SCRATCH)
    return Schedule(
        Collective.REDUCE_SCATTER,
        NAME,
        rank,
        size,
        count,
        chunk,
        drop_empty(steps),
        scratch_count=count,
    )


def allgather(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """``count`` = k; the output holds size * k elements, rank r's block at r * k."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(Collective.ALLGATHER, rank, count, chunk, rank * count, NAME)
    fold = _Fold(rank, size, _units_blocks(size, count), chunk)
    everything = fold.pieces(0, fold.p2)
    unfold_phase = fold.rounds + 1
    mine = _own(fold, rank)
    if fold.v < 0:
        steps = fold.sends(mine, rank + 1, 0, Buf.INPUT, rank * count)
        steps += fold.recvs(everything, rank + 1, unfold_phase, Buf.OUTPUT)
        return Schedule(Collective.ALLGATHER, NAME, rank, size, count, chunk, drop_empty(steps))
    steps = [Step(Kind.COPY, -1, 0, count, Buf.INPUT, 0, Buf.OUTPUT, rank * count)]
    if fold.folds:
        steps += fold.recvs(_own(fold, rank - 1), rank - 1, 0, Buf.OUTPUT)
    doubling, _ = _doubling(fold, Buf.OUTPUT, 1)
    steps += doubling
    if fold.folds:
        steps += fold.sends(everything, rank - 1, unfold_phase, Buf.OUTPUT)
    return Schedule(Collective.ALLGATHER, NAME, rank, size, count, chunk, drop_empty(steps))


def allreduce_doubling(
    rank: int, size: int, count: int, itemsize: int, chunk_bytes: int, topo: Topology | None = None
) -> Schedule:
    """``rd``: the whole vector at every distance, reduced on both sides (small messages)."""
    chunk = chunk_elems(chunk_bytes, itemsize)
    if size == 1:
        return local_copy(Collective.ALLREDUCE, rank, count, chunk, algorithm=RD_NAME)
    fold = _Fold(rank, size, [[(0, count, -1)]], chunk)
    everything = fold.pieces(0, 1)
    unfold_phase = fold.rounds + 1
    if fold.v < 0:
        steps = _folded_away(fold, everything, unfold_phase)
        return Schedule(Collective.ALLREDUCE, RD_NAME, rank, size, count, chunk, drop_empty(steps))
    steps = []
    src = Buf.INPUT
    if fold.folds:  # the even rank before this one is the lower: its data first
        steps += _recv_reduce_all(
            fold, everything, rank - 1, Buf.INPUT, Buf.OUTPUT, staged_first=True
        )
        src = Buf.OUTPUT
    d, phase, v = 1, 1, fold.v
    while d < fold.p2:
        peer = fold.real(v ^ d)
        steps += fold.sends(everything, peer, phase, src)
        steps += _recv_reduce_all(
            fold,
            everything,
            peer,
            src,
            Buf.OUTPUT,
            phase=phase,
            staged_first=(v ^ d) < v,
            finalize=2 * d == fold.p2,
        )
        src, d, phase = Buf.OUTPUT, d * 2, phase + 1
    if fold.folds:
        steps += fold.sends(everything, rank - 1, unfold_phase, Buf.OUTPUT)
    return Schedule(Collective.ALLREDUCE, RD_NAME, rank, size, count, chunk, drop_empty(steps))


def _folded_away(fold: _Fold, everything: list[Piece], unfold_phase: int) -> list[Step]:
    """An allreduce on an even rank the fold leaves out: its whole input to the odd rank after
    it, the whole result back at the unfold."""
    return fold.sends(everything, fold.rank + 1, 0, Buf.INPUT) + fold.recvs(
        everything, fold.rank + 1, unfold_phase, Buf.OUTPUT
    )


def _own(fold: _Fold, rank: int) -> list[Piece]:
    """The pieces of ``rank``'s block (rank is one that virtual rank v stands for)."""
    v = rank // 2 if rank < 2 * fold.extra else rank - fold.extra
    return [p for p in fold.pieces(v, v + 1) if p[2] == rank]


def _recv_reduce_all(
    fold: _Fold,
    pieces: list[Piece],
    peer: int,
    src: Buf,
    dst: Buf,
    phase: int = 0,
    staged_first: bool = False,
    finalize: bool = False,
) -> list[Step]:
    base = phase * fold.stride
    return [
        Step(
            Kind.RECV_REDUCE,
            peer,
            base + i,
            n,
            src,
            off,
            dst,
            off,
            finalize=finalize,
            staged_first=staged_first,
        )
        for i, (off, n, _) in enumerate(pieces)
    ]
