"""The link probe: measure the box dimensions' latency and bandwidth at init.

``DDL_LINK_PROBE=auto`` (the default) measures the dimensions that cross hosts when the job
spans hosts, ``1`` every dimension, ``0`` none; links given with ``DDL_LINK_BW`` /
``DDL_LINK_LAT`` are kept, and with both given there is nothing to measure. In-host links keep
their defaults under ``auto``: those are what the cost model's board constants
(``tuning.BOARD_BW``) were measured against, and one pair alone reads this VM's shm faster
(5-11 GB/s) than a host's ranks see it together. For each dimension it measures, two ranks one
link apart (on two hosts where it crosses the network) play ping-pong over the transport that
carries them: 8-byte round trips for latency (the median half round trip), then one-way
messages each answered by 8 bytes for bandwidth: the message doubles from 256 KiB until a round
takes 2 ms (at least two sizes) or the message reaches 16 MiB, and the bandwidth is the slope
between the last two sizes (their fastest rounds but the first), or the last size's rate where
that is lower. Tens of ms per dimension on this project's loaded 2-core VM, connecting the pair
included. The leader publishes the numbers in the rendezvous store and every rank reads them,
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
from ddlcore.planning.topology import Topology

log = logging.getLogger("ddlcore")

_SEQ = 0xC0000000  # tag space apart from collectives (< 2^31) and DDL_DEBUG's checks
_CHECK = 0x50524F43  # "PROC": every probe message carries it
_LAT_ROUNDS = 5
# The first round of a size may ride a traffic shaper's burst (tbf lets max(128 KiB, rate/1000)
# pass at once) or TCP's slow start, and be too fast: it is dropped, and the first size is twice
# tbf's smallest burst. The sizes double until a round takes _BW_TARGET_S, or _BW_ENOUGH_S at the
# first size (a slow link: latency is lost in it). Shorter rounds read shm in cache here.
_BW_ROUNDS = 3
_BW_FIRST = 256 << 10
_BW_MAX = 16 << 20
_BW_TARGET_S = 2e-3
_BW_ENOUGH_S = 20e-3
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
    big = memoryview(bytearray(_BW_MAX))
    nbytes, control = _BW_FIRST, memoryview(bytearray(8))
    before: tuple[int, float] | None = None  # (bytes, seconds) of the size before
    while True:
        trips = _round_trips(pair, big[:nbytes], small, tags, _BW_ROUNDS, leader, timeout)
        t = min(trips[1:])  # the first may ride a shaper's burst; the others: the least disturbed
        # The leader decides the next size (0: done) and tells the follower.
        if leader:
            done = (
                nbytes >= _BW_MAX or t >= _BW_ENOUGH_S or (t >= _BW_TARGET_S and before is not None)
            )
            struct.pack_into("<q", control, 0, 0 if done else 2 * nbytes)
            pair.isend(control, next(tags), _CHECK).wait(timeout)
        else:
            pair.irecv(control, next(tags), _CHECK).wait(timeout)
        following = struct.unpack_from("<q", control)[0]
        log.debug(
            "link probe, dimension %d: %d B in %s ms",
            dim,
            nbytes,
            ", ".join(f"{x * 1e3:.2f}" for x in trips),
        )
        if not following:
            break
        before, nbytes = (nbytes, t), following
    return rate(before, nbytes, t, lat), lat


def rate(before: tuple[int, float] | None, nbytes: int, t: float, lat: float) -> float:
    """Bytes/s from the last size's round (``nbytes`` in ``t`` s), the size before's (or None)
    and the latency: the slope between the two sizes is what a byte more costs, free of latency
    and of a burst; the last size alone bounds it where a disturbed smaller size made the slope
    steep (less the latency, but never more than half its round: a disturbed latency round)."""
    whole = nbytes / max(t - 2 * lat, t / 2)
    if before is not None and t > before[1]:
        return min((nbytes - before[0]) / (t - before[1]), whole)
    return whole


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
