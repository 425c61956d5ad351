"""The link probe (``DDL_LINK_PROBE=1``): measure each box dimension's latency and bandwidth.

For every dimension j of size > 1, the rank at the box's origin and its neighbour along j play
ping-pong over the transport that carries that pair: 8-byte round trips for latency (the median
half round trip), then 4 MiB one-way messages each answered by 8 bytes for bandwidth (the best
of a few, less the latency). The origin publishes the numbers in the rendezvous store and every
rank reads them, so all ranks feed the same links to the cost model and choose alike. Costs
about 0.1 s per dimension on a 1 GB/s link.
"""

from __future__ import annotations

import dataclasses
import statistics
import struct
import time

from ddlcore.topology import Topology

_SEQ = 0xC0000000          # tag space apart from collectives (< 2^31) and DDL_DEBUG's checks
_CHECK = 0x50524F43        # "PROC": every probe message carries it
_LAT_ROUNDS = 9
_BW_ROUNDS = 3
_BW_BYTES = 4 << 20


def _tag(dim: int, i: int) -> int:
    return ((_SEQ | dim) << 32) | i


def _round_trips(pair, there: memoryview, back: memoryview, dim: int, first_tag: int,
                 rounds: int, leader: bool, timeout: float) -> list[float]:
    """``rounds`` exchanges of ``there`` (leader -> follower) answered by ``back``; the
    seconds each took. Tags from ``first_tag`` on, two per round."""
    times = []
    for i in range(first_tag, first_tag + 2 * rounds, 2):
        start = time.perf_counter()
        if leader:
            pair.isend(there, _tag(dim, i), _CHECK).wait(timeout)
            pair.irecv(back, _tag(dim, i + 1), _CHECK).wait(timeout)
        else:
            pair.irecv(there, _tag(dim, i), _CHECK).wait(timeout)
            pair.isend(back, _tag(dim, i + 1), _CHECK).wait(timeout)
        times.append(time.perf_counter() - start)
    return times


def _ping_pong(pair, dim: int, leader: bool, timeout: float) -> tuple[float, float]:
    """Run the exchange with ``pair``; the leader returns (bandwidth B/s, latency s)."""
    small = memoryview(bytearray(8))
    big = memoryview(bytearray(b"\x01") * _BW_BYTES)
    rtts = _round_trips(pair, small, small, dim, 0, _LAT_ROUNDS, leader, timeout)
    lat = statistics.median(rtts) / 2
    big_trips = _round_trips(pair, big, small, dim, 2 * _LAT_ROUNDS, _BW_ROUNDS, leader, timeout)
    one_way = min(big_trips) - 2 * lat
    return _BW_BYTES / max(one_way, 1e-9), lat


def measure(topo: Topology, rank: int, links, store, timeout: float) -> Topology:
    """``topo`` with the measured bandwidth and latency of every dimension of size > 1."""
    bw, lat = list(topo.bw), list(topo.lat)
    origin = topo.order[0]
    for j, d in enumerate(topo.dims):
        if d < 2:
            continue
        coords = [0] * len(topo.dims)
        coords[j] = 1
        neighbour = topo.rank_at(coords)
        key = f"probe/{j}"
        if rank == origin:
            bw[j], lat[j] = _ping_pong(links.pair(neighbour), j, True, timeout)
            store.set(key, struct.pack("<dd", bw[j], lat[j]))
        else:
            if rank == neighbour:
                _ping_pong(links.pair(origin), j, False, timeout)
            bw[j], lat[j] = struct.unpack("<dd", store.get(key, timeout))
    return dataclasses.replace(topo, bw=tuple(bw), lat=tuple(lat), _pos=())
