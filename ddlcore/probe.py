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


def _ping_pong(pair, dim: int, leader: bool, timeout: float) -> tuple[float, float]:
    """Run the exchange with ``pair``; the leader returns (bandwidth B/s, latency s)."""
    small = memoryview(bytearray(8))
    big = memoryview(bytearray(b"\x01") * _BW_BYTES)
    i = 0
    rtts, one_way = [], []
    for _ in range(_LAT_ROUNDS):
        start = time.perf_counter()
        if leader:
            pair.isend(small, _tag(dim, i), _CHECK).wait(timeout)
            pair.irecv(small, _tag(dim, i + 1), _CHECK).wait(timeout)
        else:
            pair.irecv(small, _tag(dim, i), _CHECK).wait(timeout)
            pair.isend(small, _tag(dim, i + 1), _CHECK).wait(timeout)
        rtts.append(time.perf_counter() - start)
        i += 2
    lat = statistics.median(rtts) / 2
    for _ in range(_BW_ROUNDS):
        start = time.perf_counter()
        if leader:
            pair.isend(big, _tag(dim, i), _CHECK).wait(timeout)
            pair.irecv(small, _tag(dim, i + 1), _CHECK).wait(timeout)
        else:
            pair.irecv(big, _tag(dim, i), _CHECK).wait(timeout)
            pair.isend(small, _tag(dim, i + 1), _CHECK).wait(timeout)
        one_way.append(time.perf_counter() - start - 2 * lat)
        i += 2
    return _BW_BYTES / max(min(one_way), 1e-9), lat


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
