"""Tuning: the choice of algorithm, mdring's dimension order and its pipelined segment count
for one call, by the lowest time the cost model (`ddlcore.planning.tuning_model`, its names re-exported
here) predicts, ties going to the simplest.

``DDL_ALGO`` names the algorithm of the reduction collectives (those without it, e.g.
reduce_scatter under ``rd``, fall back to ``auto``); ``auto`` takes the lowest predicted time
(for mdring also over the order of the box dimensions). Broadcast and barrier have one
algorithm each (pipelined chain, dissemination). The chunk size is ``DDL_CHUNK_BYTES``.
``DDL_DEBUG=1`` logs each choice and ``python -m ddlcore info`` prints it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from ddlcore.algorithms import ALGORITHMS
from ddlcore.algorithms.mdring import active_dims
from ddlcore.collectives import Collective
from ddlcore.planning.tuning_model import (
    BOARD_BW,
    BOARD_SYNC_S,
    CHUNK_BYTES,
    REDUCE_BW,
    host_first,
    in_rank_order,
    model_bytes,
    pipeline_lead,
    predict,
)
from ddlcore.topology import Topology

__all__ = [
    "BOARD_BW",
    "BOARD_SYNC_S",
    "CHUNK_BYTES",
    "DIRECT",
    "LEAD",
    "MAX_PERMUTED_DIMS",
    "MIN_SEGMENT_BYTES",
    "REDUCE_BW",
    "SEGMENT_CHUNKS",
    "SEGMENT_COUNTS",
    "SELECTABLE",
    "TIE",
    "Choice",
    "best_mdring",
    "candidates",
    "choose",
    "dim_orders",
    "host_first",
    "host_segments",
    "in_rank_order",
    "model_bytes",
    "pipeline_lead",
    "predict",
    "segment_counts",
    "validate_algo",
]

# Collectives for which DDL_ALGO selects among several algorithms.
# As plain strings: argparse lists them in its messages (`ddlcore.simulate`).
SELECTABLE = tuple(
    c.value for c in (Collective.ALLREDUCE, Collective.REDUCE_SCATTER, Collective.ALLGATHER)
)
# Predictions this close count as a tie (the model is not that precise).
TIE = 0.01
# mdring dimension orders tried by auto: all of them up to this many dimensions.
MAX_PERMUTED_DIMS = 4
# mdring's pipelined segment counts tried by auto, and the smallest segment where no link leads
# the pipeline (below): on the paper's links (20 GB/s in a host, 10 GB/s adapters shared by 4
# GPUs) segments under 8 MiB ran up to 1.4x slower in the simulator than the model says (the
# phases' messages meet at FIFO ports in an order it does not price), and each segment costs the
# engine a few Python-level waits per phase.
SEGMENT_COUNTS = (1, 2, 4, 8, 16, 32, 64)
MIN_SEGMENT_BYTES = 8 << 20
# ... but where the busiest link's pace is at least LEAD times the next link's, the segments
# queue behind that one link as the model says: the simulator stays within 1% of it down to 64
# segments on 1.25 and 0.125 GB/s networks under 5-20 GB/s host links (2x2 to 8x4 boxes: leads
# of 8-40), and on the netns testbed (2x2, 1 Gbit/s, TCP in the hosts: a lead of 5, 16 MB) 4
# segments of 4 MiB ran at 1.11-1.12x the link bound and 8 at 1.09x, against 1.17x with 2 of
# 8 MiB. The paper's boxes lead by 1.0-2.8 (at 4x4, exactly 2: 8 segments of 4 MiB simulated 7%
# slower than modelled). There a segment need only hold SEGMENT_CHUNKS chunks.
LEAD = 3.0
# ... and at least this many pipeline chunks: a segment of fewer has too little to pipeline
# within each step. On the GPU (4 MiB chunks, 2x2 box, one H200), 64 MB: 8 segments 1.9 GB/s
# busbw, 4 segments 2.4-2.8, 2 segments 2.6 (BENCHMARKS).
SEGMENT_CHUNKS = 4
# mdring with host phases on the boards (``ddlcore.execution.paths.host_staged``) splits an allreduce into
# segments of at least this many bytes, at most _HOST_SEGMENTS of them, pipelined on two
# threads (``ddlcore.execution.pipeline``): on the netns testbed at 4x2, 1 Gbit/s, 64 MB went from
# 1.22-1.28x the link bound to 1.09x (BENCHMARKS.md).
_HOST_SEGMENT_BYTES = 4 << 20
_HOST_SEGMENTS = 8


@dataclass(frozen=True)
class Choice:
    algorithm: str
    chunk_bytes: int
    dim_order: tuple[int, ...] | None = None  # mdring: the order of the ring phases
    predicted_s: float = math.nan
    host_path: str = ""  # mdring: the host dimensions run as this host collective instead
    segments: int = 1  # mdring allreduce: pipelined across the dimensions in this many

    def describe(self) -> str:
        text = f"{self.algorithm}"
        if self.dim_order is not None:
            text += f" (dimensions in order {','.join(map(str, self.dim_order))})"
        if self.host_path:
            text += f", host dimensions through shared memory ({self.host_path})"
        if self.segments > 1:
            text += f", pipelined in {self.segments} segments"
        text += f", chunks of {self.chunk_bytes} B"
        if not math.isnan(self.predicted_s):
            text += f", predicted {self.predicted_s * 1e6:.1f} us"
        return text


# The host collectives' name (``ddlcore.execution.hostcoll``): not a schedule, a whole collective through
# shared memory, taken under ``auto`` whenever every rank is on one host and talks shm.
DIRECT = "direct"


def validate_algo(algo: str) -> None:
    """ValueError naming DDL_ALGO if no reduction collective knows ``algo``."""
    if algo in ("auto", DIRECT):
        return
    known = sorted({name for coll in SELECTABLE for name in ALGORITHMS[coll]})
    if algo not in known:
        raise ValueError(
            f"DDL_ALGO={algo!r} is not an algorithm; use auto, {DIRECT} or one of {known}"
        )


def host_segments(nbytes: int) -> int:
    """How many pipelined segments an allreduce of ``nbytes`` takes on the host-staged path
    (the same on every rank: a function of the size alone)."""
    return max(1, min(_HOST_SEGMENTS, int(nbytes) // _HOST_SEGMENT_BYTES))


def segment_counts(
    nbytes: float, chunk_bytes: int = 0, lead: Callable[[float], float] | None = None
) -> list[int]:
    """The pipelined segment counts worth pricing for an allreduce of ``nbytes`` in chunks of
    ``chunk_bytes``: segments of at least SEGMENT_CHUNKS chunks, and of MIN_SEGMENT_BYTES
    unless ``lead`` (of a segment's bytes: `tuning_model.pipeline_lead`) is at least LEAD."""
    smallest = SEGMENT_CHUNKS * (chunk_bytes or CHUNK_BYTES)
    return [
        s
        for s in SEGMENT_COUNTS
        if s == 1
        or nbytes / s >= max(smallest, MIN_SEGMENT_BYTES)
        or (nbytes / s >= smallest and lead is not None and lead(nbytes / s) >= LEAD)
    ]


def best_mdring(
    collective: str,
    topo: Topology,
    nbytes: float,
    order: tuple[int, ...],
    reduce_bw: float,
    host_path: bool,
    segments: int = 0,
    chunk_bytes: int = 0,
) -> tuple[float, int]:
    """(predicted seconds, segments) of mdring in ``order``: ``segments`` if given (> 0),
    else the best count for ``chunk_bytes`` (the host-staged path's own where it runs)."""

    def led(segment_bytes: float) -> float:  # priced as `predict` below prices the counts
        return pipeline_lead(topo, segment_bytes, order, reduce_bw)

    if collective != Collective.ALLREDUCE:
        counts = [1]
    elif host_path and host_first(topo, order):
        counts = [host_segments(int(nbytes))]
    else:
        counts = [segments] if segments > 0 else segment_counts(nbytes, chunk_bytes, led)
    return min(
        (
            predict(
                collective,
                "mdring",
                topo,
                nbytes,
                order,
                reduce_bw,
                host_path=host_path,
                segments=s,
            ),
            s,
        )
        for s in counts
    )


def dim_orders(topo: Topology) -> list[tuple[int, ...]]:
    """mdring phase orders auto tries: every permutation of a small box, else fastest first."""
    k = len(topo.dims)
    if k > MAX_PERMUTED_DIMS:
        return [tuple(range(k))]
    return list(itertools.permutations(range(k)))


def candidates(
    collective: str,
    topo: Topology,
    nbytes: float,
    host_path: bool = False,
    segments: int = 0,
    chunk_bytes: int = 0,
) -> list[Choice]:
    """Every (algorithm, dimension order) for ``collective`` with its predicted time, best
    first; mdring with its best segment count for ``chunk_bytes`` (or ``segments``, if > 0)."""
    out = []
    for name in ALGORITHMS[collective]:
        if name == "mdring":
            if len(active_dims(topo)) <= 1:
                if not in_rank_order(topo):  # the ring in box order, not rank order
                    out.append(Choice(name, 0, None, predict(collective, name, topo, nbytes)))
                continue  # in rank order, a box with one dimension makes mdring the ring
            for order in dim_orders(topo):
                t, nseg = best_mdring(
                    collective, topo, nbytes, order, REDUCE_BW, host_path, segments, chunk_bytes
                )
                out.append(Choice(name, 0, order, t, segments=nseg))
        else:
            out.append(Choice(name, 0, None, predict(collective, name, topo, nbytes)))
    # Ties go to the registry's order (the simplest first).
    return sorted(out, key=lambda c: c.predicted_s)


def choose(
    collective: str,
    topo: Topology,
    nbytes: int,
    algo: str,
    chunk_bytes: int,
    host_path: bool = False,
    segments: int = 0,
) -> Choice:
    """The algorithm for one call: ``algo`` if named and ``collective`` has it (``rd`` is an
    allreduce only: the other collectives then take the cost model's choice), else the lowest
    predicted time (``host_path``: as `predict`; ``segments`` > 0: mdring's allreduce in that
    many pipelined segments, else the cost model's count)."""
    candidates_of = ALGORITHMS[collective]
    if collective not in SELECTABLE:
        return Choice(next(iter(candidates_of)), chunk_bytes)
    if algo != "auto" and algo in candidates_of:
        if algo == "mdring" and len(active_dims(topo)) > 1:
            best = min(
                (
                    c
                    for c in candidates(collective, topo, nbytes, host_path, segments, chunk_bytes)
                    if c.algorithm == algo
                ),
                key=lambda c: c.predicted_s,
            )
            return dataclasses.replace(best, chunk_bytes=chunk_bytes)
        if algo == "mdring":  # one ring in box order, whatever the order of the dimensions
            return min(
                (
                    Choice(
                        "mdring",
                        chunk_bytes,
                        order,
                        predict(collective, algo, topo, nbytes, order, host_path=host_path),
                    )
                    for order in dim_orders(topo)
                ),
                key=lambda c: c.predicted_s,
            )
        return Choice(algo, chunk_bytes, None, predict(collective, algo, topo, nbytes))
    ranked = candidates(collective, topo, nbytes, host_path, segments, chunk_bytes)
    # Within TIE of the best, the simplest (registry order: ring, mdring, rhd, rd) wins; but
    # where ranks are not placed host by host, the ring in box order (mdring) goes before the
    # ring in rank order: it never crosses more host boundaries, and a flat box (uneven hosts)
    # cannot price the boundaries the rank-order ring crosses.
    order = list(candidates_of)
    if not in_rank_order(topo) and "mdring" in order:
        order.remove("mdring")
        order.insert(0, "mdring")
    near = [c for c in ranked if c.predicted_s <= ranked[0].predicted_s * (1 + TIE)]
    best = min(near, key=lambda c: order.index(c.algorithm))
    return dataclasses.replace(best, chunk_bytes=chunk_bytes)
