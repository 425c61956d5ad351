"""The link probe: measure the box dimensions' latency and bandwidth at init.

``DDL_LINK_PROBE=auto`` (the default) measures the dimensions that cross hosts when the job
spans hosts, ``1`` every dimension, ``0`` none; links given with ``DDL_LINK_BW`` /
``DDL_LINK_LAT`` are kept, and with both given there is nothing to measure. In-host links keep
their defaults under ``auto``: those are what the cost model's board constants
(``tuning.BOARD_BW``) were measured against, and one pair alone reads this VM's shm faster
(5-11 GB/s) than a host's ranks see it together. For each dimension it measures, two ranks one
link apart (on two hosts where it crosses the network) play ping-pong over the transport that
carries them: 8-byte round trips for latency (the median half round trip), then, for
bandwidth, one-way messages each answered by 8 bytes once its last byte has arrived, so a round
times what crossed the link, not what a socket buffer or a queue took in. The message grows
from 256 KiB (one round a size, jumps of up to 16x) until a round takes 25 ms at 2 MiB or more
(or 0.25 s, or the message reaches 64 MiB); that size runs three rounds, and the bandwidth is
the message over the median round, latency included. Load and latency read a link low, never
high; only a shaper's burst (tbf passes max(128 KiB, rate/1000) at once) reads it high, by at
most burst/message (3% at 1 Gbit/s, where TCP's headers, which the shaper counts, take 4.4%).
Its cost is about four rounds of 25 ms or more: ~0.15 s (a 256 KiB round, three of 4 MiB) on
a 1 Gbit/s link, 20-60 ms on fast links (64 MiB rounds), ~0.5 s at 100 Mbit/s; past 0.25 s a
round only where 256 KiB takes that long.

The leader publishes the numbers in the rendezvous store and every rank reads them,
so all ranks feed the same links to the cost model and choose alike; a failure is published
too, so every rank raises instead of waiting.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import struct
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from ddlcore import config
from ddlcore.errors import DDLError, rewrap
from ddlcore.topology import Topology

log = logging.getLogger("ddlcore")

_SEQ = 0xC0000000  # tag space apart from collectives (< 2^31) and DDL_DEBUG's checks
_CHECK = 0x50524F43  # "PROC": every probe message carries it
_LAT_ROUNDS = 5
# A reading is the message over a whole round, so a round only looks fast where a shaper's
# burst passes at once (tbf's is max(128 KiB, rate/1000)): a round of at least _BW_TARGET_S and
# _BW_MIN_BYTES keeps that burst within 1/16 of it (1/25 at 1 Gbit/s and above); rounds of a
# few ms read a shaped link fast. A round of _BW_LONG_S ends the growth whatever its size, so a
# slow link stays cheap; _BW_GROWTH caps a jump, which a burst-fast small round would make too
# long.
_BW_ROUNDS = 3
_BW_FIRST = 256 << 10
_BW_MIN_BYTES = 2 << 20
_BW_MAX = 64 << 20
_BW_TARGET_S = 25e-3
_BW_LONG_S = 0.25
_BW_GROWTH = 16
_STEP = struct.Struct("<qq")  # the leader's word before each step: (bytes, rounds)
_OK, _FAILED = b"K", b"E"


def wanted(mode: str, nhosts: int, environ: Mapping[str, str] | None = None) -> bool:
    """Whether init measures the links: ``mode`` is DDL_LINK_PROBE ("auto", "1", "0")."""
    if config.get("DDL_LINK_BW", environ) and config.get("DDL_LINK_LAT", environ):
        return False  # both given: nothing left to measure
    return mode == "1" or (mode == "auto" and nhosts > 1)


def _tags(dim: int) -> Iterator[int]:
    i = 0
    while True:
        yield ((_SEQ | dim) << 32) | i
        i += 1


def _round_trips(
    pair: Any,
    there: memoryview,
    back: memoryview,
    tags: Iterator[int],
    rounds: int,
    leader: bool,
    timeout: float,
) -> list[float]:
    """``rounds`` exchanges of ``there`` (leader -> follower) answered by ``back``; the
    seconds each took."""
    times = []
    for _ in range(rounds):
        go, reply = next(tags), next(tags)
        start = time.perf_counter()
        if leader:
            pair.isend(there, go, _CHECK).wait(timeout)
            pair.irecv(back, reply, _CHECK).wait(timeout)
        else:
            pair.irecv(there, go, _CHECK).wait(timeout)
            pair.isend(back, reply, _CHECK).wait(timeout)
        times.append(time.perf_counter() - start)
    return times


def _ping_pong(pair: Any, dim: int, leader: bool, timeout: float) -> tuple[float, float]:
    """Run the exchange with ``pair``; the leader returns (bandwidth B/s, latency s)."""
    tags = _tags(dim)
    small = memoryview(bytearray(8))
    rtts = _round_trips(pair, small, small, tags, _LAT_ROUNDS, leader, timeout)
    lat = statistics.median(rtts) / 2
    log.debug(
        "link probe, dimension %d: 8 B round trips in %s ms",
        dim,
        ", ".join(f"{x * 1e3:.2f}" for x in rtts),
    )
    big = bytearray()  # grown with the message; the pages a size never uses stay untouched
    step = memoryview(bytearray(_STEP.size))
    nbytes, rounds, trips = _BW_FIRST, 1, []
    while True:
        # The leader decides each step and tells the follower: (bytes, rounds); no rounds: done.
        if leader:
            _STEP.pack_into(step, 0, nbytes, rounds)
            pair.isend(step, next(tags), _CHECK).wait(timeout)
        else:
            pair.irecv(step, next(tags), _CHECK).wait(timeout)
            nbytes, rounds = _STEP.unpack_from(step)
        if not rounds:
            break
        if len(big) < nbytes:
            big = bytearray(nbytes)
        got = _round_trips(pair, memoryview(big)[:nbytes], small, tags, rounds, leader, timeout)
        log.debug(
            "link probe, dimension %d: %d B in %s ms",
            dim,
            nbytes,
            ", ".join(f"{x * 1e3:.2f}" for x in got),
        )
        if leader:
            trips += got
            nbytes, rounds, trips = next_step(nbytes, trips)
    return (rate(nbytes, trips) if leader else 0.0), lat


def next_step(nbytes: int, trips: list[float]) -> tuple[int, int, list[float]]:
    """The leader's next step after ``trips`` (seconds) of ``nbytes``-byte rounds: (bytes,
    rounds to run, the rounds of that size so far); (the same bytes, 0, trips) when done.

    A size whose median round reaches the target (_BW_TARGET_S and _BW_MIN_BYTES, or
    _BW_LONG_S, or the largest size) runs _BW_ROUNDS rounds; a shorter one gives way to the
    power-of-two multiple (2x to _BW_GROWTH, short of _BW_LONG_S) that should reach it. A
    first round that reached the target only by load is outvoted by the next two, and the
    message grows again."""
    t = statistics.median(trips)
    if nbytes >= _BW_MAX or t >= _BW_LONG_S or (t >= _BW_TARGET_S and nbytes >= _BW_MIN_BYTES):
        if len(trips) >= _BW_ROUNDS:
            return nbytes, 0, trips
        return nbytes, _BW_ROUNDS - len(trips), trips
    grow = 2
    while grow < _BW_GROWTH and (grow * t < _BW_TARGET_S or grow * nbytes < _BW_MIN_BYTES):
        grow *= 2
    while grow > 2 and grow * t > _BW_LONG_S:  # bytes alone do not earn a round that long
        grow //= 2
    return min(nbytes * grow, _BW_MAX), 1, []


def rate(nbytes: int, trips: list[float]) -> float:
    """Bytes/s of ``nbytes``-byte rounds that took ``trips`` seconds each (latency included):
    the median round's. Load and latency only lengthen a round, so this reads a link low, never
    high, but by a shaper's burst: at most ``burst / nbytes`` above the link's rate."""
    return nbytes / statistics.median(trips)


def _pair_across(topo: Topology, dim: int, host_of: Sequence[str]) -> tuple[int, int]:
    """Two ranks one link of ``dim`` apart, from the box's origin on; on two hosts where the
    dimension crosses the network (a flat box over uneven hosts starts inside one)."""
    ring = topo.ring_along(topo.order[0], dim)
    pairs = list(zip(ring[:-1], ring[1:], strict=True))
    if topo.levels[dim] != "host":
        for a, b in pairs:
            if host_of[a] != host_of[b]:
                return a, b
    return pairs[0]


def measure(
    topo: Topology,
    rank: int,
    links: Any,
    store: Any,
    timeout: float,
    host_of: Sequence[str],
    environ: Mapping[str, str] | None = None,
    in_host: bool = True,
) -> Topology:
    """``topo`` with the measured bandwidth and latency of every dimension of size > 1 (those
    DDL_LINK_BW / DDL_LINK_LAT give are kept), or, without ``in_host``, of those that cross
    hosts.

    Raises
    ------
    DDLError (or the transport's subclass of it)
        On every rank when the exchange fails on either rank of a pair; names the dimension,
        the pair and its transport.
    """
    bw, lat = list(topo.bw), list(topo.lat)
    keep_bw, keep_lat = (
        bool(config.get("DDL_LINK_BW", environ)),
        bool(config.get("DDL_LINK_LAT", environ)),
    )
    for j, d in enumerate(topo.dims):
        if d < 2 or (topo.levels[j] == "host" and not in_host):
            continue
        leader, follower = _pair_across(topo, j, host_of)
        key = f"probe/{j}"
        over = (
            f", over {links.choice[follower if rank == leader else leader]}"
            if rank in (leader, follower)
            else ""
        )
        what = (
            f"the link probe of dimension {j} ({topo.levels[j]}: rank {leader} with rank "
            f"{follower}{over})"
        )
        start = time.perf_counter()
        try:
            if rank == leader:
                try:
                    got = _ping_pong(links.pair(follower), j, True, timeout)
                except BaseException as exc:
                    try:  # the others wait for the numbers: tell them there are none
                        store.set(
                            key,
                            _FAILED + f"{type(exc).__name__}: {exc}".encode()[:2000],
                            readers=topo.size - 1,
                        )
                    except Exception:  # (the store gone too): the first error is the one to say
                        log.debug(
                            "rank %d: could not publish the probe's failure", rank, exc_info=True
                        )
                    raise
                store.set(key, _OK + struct.pack("<dd", *got), readers=topo.size - 1)
            else:
                if rank == follower:
                    _ping_pong(links.pair(leader), j, False, timeout)
                raw = store.get(key, timeout)
                if raw[:1] != _OK:
                    err = DDLError(f"rank {leader} failed: {raw[1:].decode('utf-8', 'replace')}")
                    err.origin = leader
                    raise err
                got = struct.unpack("<dd", raw[1:])
        except DDLError as exc:
            raise rewrap(
                exc,
                f"rank {rank}: {what} failed: {exc}; DDL_LINK_PROBE=0 skips it "
                "(DDL_LINK_BW / DDL_LINK_LAT then give the links)",
            ) from exc
        bw[j] = bw[j] if keep_bw else got[0]
        lat[j] = lat[j] if keep_lat else got[1]
        log.debug(
            "rank %d: %s: %.3g GB/s, %.3g us (%.1f ms)",
            rank,
            what,
            got[0] / 1e9,
            got[1] * 1e6,
            (time.perf_counter() - start) * 1e3,
        )
    return dataclasses.replace(topo, bw=tuple(bw), lat=tuple(lat), _pos=())
