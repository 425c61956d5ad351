"""Topology: which ranks share a host (and a rack), the box the ranks form, and its links.

Two ranks are on the same host only if they share hostname AND network namespace, so hosts
emulated with network namespaces on one machine count as different hosts; ``DDL_HOST_ID``
overrides the identity and ``DDL_RACK_ID`` groups hosts into racks. Local ranks are numbered by
global rank within each host, hosts by their lowest global rank.

The box (the multi-dimensional ring's arrangement, DESIGN.md) is ``d1 x d2 x ... x dk``, the
fastest level first: derived as ranks-per-host x hosts-per-rack x racks, or given with
``DDL_TOPOLOGY``. Ranks are placed in it by (rack, host, local rank), so every host is a sub-box
of the leading dimensions whatever the launcher's placement: ranks placed host by host (block)
keep their rank as box position; ranks dealt round-robin over the hosts (cyclic: ranks 0, 2 on
one host, 1, 3 on the other) get a permutation, ``Topology.order``, between box position and
rank. Each dimension has a link bandwidth and latency: defaults from the transport that carries
that level (a network never faster than the hosts' shared memory), ``DDL_LINK_BW`` /
``DDL_LINK_LAT`` to override, and a short probe at init to measure them (``ddlcore.job.probe``; by
default when the job spans hosts). Uneven hosts (3 + 2 ranks) give a flat, 1-D box, whose ring
in box order (mdring on one dimension) still follows hosts; the reason is kept in
`Topology.note`.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddlcore import config

# Per-transport link defaults: (bytes/s, seconds per message). shm: measured on this project's
# 2-core VM (BENCHMARKS.md, 4.6-7 GB/s, 14-20 us one-way); tcp: a 10 GbE link and a kernel
# stack's one-way latency; ucx: 100 Gb/s InfiniBand; mpi: a cluster MPI over a fast fabric.
LINK_DEFAULTS: dict[str, tuple[float, float]] = {
    "shm": (5e9, 15e-6),
    "tcp": (1.25e9, 50e-6),
    "ucx": (12.5e9, 3e-6),
    "mpi": (12.5e9, 5e-6),
}
_FALLBACK_LINK = LINK_DEFAULTS["tcp"]
# How much slower than the in-host level a level across hosts is priced, at least, until a probe
# measures it: as 10 GbE (tcp's default) to shm. Below 1/2, mdring goes host first (`link_defaults`).
NETWORK_SLOWER = 4.0


def host_identity(environ: Mapping[str, str] | None = None) -> str:
    override = config.get("DDL_HOST_ID", environ)
    if override:
        return override
    try:
        netns = f"netns:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:  # not Linux, or /proc hidden: hostname alone
        netns = "netns:?"
    return f"{socket.gethostname()}/{netns}"


def rack_identity(environ: Mapping[str, str] | None = None) -> str:
    return str(config.get("DDL_RACK_ID", environ))


@dataclass(frozen=True)
class HostLayout:
    """Where each rank sits: host index per rank, and this rank's local position."""

    host_of: tuple[int, ...]  # host index of every rank
    local_rank: int
    local_size: int
    nhosts: int

    @property
    def ranks_per_host(self) -> tuple[int, ...]:
        return tuple(self.host_of.count(h) for h in range(self.nhosts))


def layout(host_ids: Sequence[str], rank: int) -> HostLayout:
    index: dict[str, int] = {}
    host_of = tuple(index.setdefault(h, len(index)) for h in host_ids)
    mine = host_of[rank]
    local = [r for r, h in enumerate(host_of) if h == mine]
    return HostLayout(host_of, local.index(rank), len(local), len(index))


@dataclass(frozen=True, eq=False)
class Topology:
    """The ranks as a box, with the link each dimension crosses.

    ``order[p]`` is the rank at box position ``p``; position and coordinates are mixed-radix,
    dimension 0 fastest: ``p = c0 + d0 * (c1 + d1 * (c2 + ...))``. Ranks that differ only in
    ``c0`` share the fastest link. Compared and hashed by identity: one per communicator.
    """

    dims: tuple[int, ...]
    order: tuple[int, ...]
    bw: tuple[float, ...]  # bytes/s of one link along each dimension
    lat: tuple[float, ...]  # seconds per message along each dimension
    levels: tuple[str, ...]  # what each dimension crosses: "host", "network", "rack"...
    note: str = ""  # why the box is flat, when the hosts do not form one
    adapters: int = 1  # network adapters per host, shared by its ranks
    _pos: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if math.prod(self.dims) != len(self.order) or sorted(self.order) != list(
            range(len(self.order))
        ):
            raise ValueError(
                f"box {self.dims} does not hold the {len(self.order)} ranks {self.order}"
            )
        if not len(self.bw) == len(self.lat) == len(self.levels) == len(self.dims):
            raise ValueError("one bandwidth, latency and level per dimension")
        pos = [0] * len(self.order)
        for p, r in enumerate(self.order):
            pos[r] = p
        object.__setattr__(self, "_pos", tuple(pos))

    @property
    def size(self) -> int:
        return len(self.order)

    @property
    def shape(self) -> str:
        return "x".join(map(str, self.dims))

    def position(self, rank: int) -> int:
        return self._pos[rank]

    def coords(self, rank: int) -> tuple[int, ...]:
        p, out = self._pos[rank], []
        for d in self.dims:
            p, c = divmod(p, d)
            out.append(c)
        return tuple(out)

    def rank_at(self, coords: Sequence[int]) -> int:
        p = 0
        for d, c in zip(reversed(self.dims), reversed(coords), strict=True):
            p = p * d + c
        return self.order[p]

    def ring_along(self, rank: int, dim: int) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``dim``, by their coordinate there."""
        c = list(self.coords(rank))
        members = []
        for i in range(self.dims[dim]):
            c[dim] = i
            members.append(self.rank_at(c))
        return tuple(members)

    def dim_between(self, a: int, b: int) -> int:
        """The slowest dimension in which ranks ``a`` and ``b`` differ (-1 when a == b): the
        link a message between them crosses."""
        ca, cb = self.coords(a), self.coords(b)
        return max((j for j in range(len(self.dims)) if ca[j] != cb[j]), default=-1)

    @property
    def host_dims(self) -> int:
        """How many leading dimensions stay inside a host (their links are per rank; the
        others share the host's network adapter)."""
        n = 0
        while n < len(self.levels) and self.levels[n] == "host":
            n += 1
        return n

    @property
    def ranks_per_node(self) -> int:
        """Ranks that share one network adapter (a host)."""
        return math.prod(self.dims[: self.host_dims])

    def adapter_of(self, rank: int) -> tuple[int, int]:
        """(host, adapter) through which ``rank`` reaches the network: local rank i (its
        position in its host's sub-box, which is `layout`'s local rank) uses adapter i mod
        ``adapters``, as the tcp transport gives it the (i mod A)-th ``DDL_SOCKET_IFNAME``."""
        pos = self._pos[rank]
        return pos // self.ranks_per_node, (pos % self.ranks_per_node) % self.adapters

    def node_of(self, rank: int) -> int:
        """Index of the host (network adapter) of ``rank`` in the box."""
        return self._pos[rank] // self.ranks_per_node

    def describe(self) -> str:
        parts = [
            f"{d} ({lvl}, {bw / 1e9:.3g} GB/s, {lat * 1e6:.3g} us)"
            for d, lvl, bw, lat in zip(self.dims, self.levels, self.bw, self.lat, strict=True)
        ]
        text = " x ".join(parts)
        if self.adapters > 1:
            text += (
                f"; {self.adapters} network adapters per host (local rank i uses i mod "
                f"{self.adapters})"
            )
        return f"{text}; {self.note}" if self.note else text


def flat(
    size: int, bw: float = _FALLBACK_LINK[0], lat: float = _FALLBACK_LINK[1], level: str = "network"
) -> Topology:
    """A 1-D box in rank order: what the algorithms assume when given no topology."""
    return Topology((size,), tuple(range(size)), (bw,), (lat,), (level,))


def default_levels(k: int) -> tuple[str, ...]:
    """Level names of a k-dimensional box given only by its shape: the first dimension inside
    a host, the others across the network (hosts, then racks)."""
    if k == 1:
        return ("network",)
    if k == 3:
        return ("host", "rack", "cross-rack")
    return ("host",) + tuple("network" if k == 2 else f"network{j}" for j in range(1, k))


def box(
    dims: Sequence[int],
    bw: Sequence[float],
    lat: Sequence[float],
    levels: Sequence[str] | None = None,
    adapters: int = 1,
) -> Topology:
    """A box in rank order with the given links (the simulator's and the tests' topologies)."""
    dims = tuple(int(d) for d in dims)
    return Topology(
        dims,
        tuple(range(math.prod(dims))),
        tuple(map(float, bw)),
        tuple(map(float, lat)),
        tuple(levels or default_levels(len(dims))),
        adapters=adapters,
    )


def per_dim(values: Sequence[float], k: int, what: str) -> tuple[float, ...]:
    """One value per dimension from a list of 1 (applies to all), k, or more (the slowest level
    repeats: ``20e9,10e9`` for a 3-D box means 20, 10, 10)."""
    if not values:
        raise ValueError(f"{what}: no values")
    if any(not v > 0 for v in values):
        raise ValueError(f"{what}: every value must be positive, got {list(values)}")
    if len(values) > k:
        raise ValueError(f"{what}: {len(values)} values for a box of {k} dimensions")
    return tuple(float(values[min(j, len(values) - 1)]) for j in range(k))


def link_defaults(
    levels: Sequence[str], level_transport: Mapping[str, str], cpu_share: float = 1.0
) -> list[tuple[float, float]]:
    """(bytes/s, s) of each level before a probe: the defaults of the transport carrying it, a
    level across hosts priced at most 1/`NETWORK_SLOWER` of the job's in-host level and never
    quicker to answer. Priced faster (ucx's 12.5 GB/s against shm's 5), the network went first
    in mdring and ran 2.3x the 1 Gbit/s testbed's bound (issue 21); priced alike, the flat ring
    won (1.6x); a slower network makes mdring go host first (1.1x), which costs at most 1.33x
    where the network really is as fast as shared memory.

    TCP inside a host is the kernel copying every byte on the machine's CPUs: where ranks
    outnumber them (``cpu_share`` < 1, a CPU's share per rank), each rank's link runs at its
    share, and a level across hosts stays priced below it as above (its own bytes cross the same
    CPUs) until a probe measures it. On the testbed (two emulated hosts on 2 vCPUs), loopback TCP
    moved ~2.2 GB/s for all ranks together: 0.28 GB/s a rank at 4x2, against tcp's default 1.25."""

    def of(level: str) -> tuple[float, float]:
        name = level_transport.get("host" if level == "host" else "network", "")
        bw, lat = LINK_DEFAULTS.get(name, _FALLBACK_LINK)
        if level == "host" and name == "tcp":
            bw *= min(1.0, cpu_share)
        return bw, lat

    host_bw, host_lat = of("host")
    return [
        of(lvl)
        if lvl == "host" or "host" not in levels
        else (min(of(lvl)[0], host_bw / NETWORK_SLOWER), max(of(lvl)[1], host_lat))
        for lvl in levels
    ]


def _uniform(counts: Sequence[int]) -> int | None:
    return counts[0] if counts and all(c == counts[0] for c in counts) else None


def build(
    host_ids: Sequence[str],
    rack_ids: Sequence[str],
    level_transport: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
    cpu_share: float = 1.0,
) -> Topology:
    """The job's box from every rank's host and rack identity.

    ``level_transport`` names the transport between two ranks of one host (``"host"``) and of two
    hosts (``"network"``); it sets the link defaults, with ``cpu_share`` (`link_defaults`: the
    share of a CPU each rank has where the job is most crowded). Raises ValueError naming ``DDL_TOPOLOGY``
    when the given box does not hold the ranks or splits a host, and naming ``DDL_LINK_BW`` /
    ``DDL_LINK_LAT`` when they do not fit the box.
    """
    size = len(host_ids)
    hosts = layout(host_ids, 0)
    racks_of_host: dict[int, str] = {}
    for r, h in enumerate(hosts.host_of):
        racks_of_host.setdefault(h, rack_ids[r] if r < len(rack_ids) else "")
    rack_index: dict[str, int] = {}
    for h in range(hosts.nhosts):
        rack_index.setdefault(racks_of_host[h], len(rack_index))
    # Place ranks by (rack, host, local rank): hosts become sub-boxes of the leading dimensions.
    order = tuple(
        sorted(
            range(size),
            key=lambda r: (rack_index[racks_of_host[hosts.host_of[r]]], hosts.host_of[r], r),
        )
    )
    per_host = _uniform(hosts.ranks_per_host)
    hosts_per_rack = _uniform(
        [
            sum(1 for h in range(hosts.nhosts) if rack_index[racks_of_host[h]] == k)
            for k in range(len(rack_index))
        ]
    )
    given = config.get("DDL_TOPOLOGY", environ)
    note = ""
    if given:
        dims = tuple(given)
        if math.prod(dims) != size:
            raise ValueError(
                f"DDL_TOPOLOGY={'x'.join(map(str, dims))} holds {math.prod(dims)} "
                f"ranks but the job has {size}"
            )
        if per_host is None and len(dims) > 1:
            raise ValueError(
                f"DDL_TOPOLOGY={'x'.join(map(str, dims))}: the hosts have "
                f"{list(hosts.ranks_per_host)} ranks; a box needs the same number "
                "on every host (unset DDL_TOPOLOGY for a flat ring)"
            )
        prefixes = [math.prod(dims[:j]) for j in range(len(dims) + 1)]
        if per_host is not None and per_host not in prefixes and len(dims) > 1:
            raise ValueError(
                f"DDL_TOPOLOGY={'x'.join(map(str, dims))} splits a host: each host "
                f"has {per_host} ranks, which is not a product of the leading "
                f"dimensions {prefixes[1:-1]}"
            )
    elif per_host is None:
        dims = (size,)
        note = (
            f"flat: the hosts have {list(hosts.ranks_per_host)} ranks, not the same number on each"
        )
    else:
        racks = len(rack_index)
        if racks > 1 and hosts_per_rack is not None:
            dims = (per_host, hosts_per_rack, racks)
        else:
            dims = (per_host, hosts.nhosts)
            if racks > 1:
                note = "racks ignored: they hold different numbers of hosts"
        dims = tuple(d for d in dims if d > 1) or (1,)
    groups_per_rack = per_host * hosts_per_rack if per_host and hosts_per_rack else None
    levels = []
    for j in range(len(dims)):
        reach = math.prod(dims[: j + 1])  # ranks in one group of dimensions 0..j
        if hosts.nhosts == 1 or (per_host is not None and reach <= per_host):
            levels.append("host")
        elif len(rack_index) > 1 and groups_per_rack is not None:
            levels.append("rack" if reach <= groups_per_rack else "cross-rack")
        else:
            levels.append("network")
    defaults = link_defaults(levels, level_transport, cpu_share)
    bw_env = config.get("DDL_LINK_BW", environ)
    lat_env = config.get("DDL_LINK_LAT", environ)
    bw = per_dim(bw_env, len(dims), "DDL_LINK_BW") if bw_env else tuple(d[0] for d in defaults)
    lat = per_dim(lat_env, len(dims), "DDL_LINK_LAT") if lat_env else tuple(d[1] for d in defaults)
    adapters = (
        network_adapters(level_transport.get("network", ""), environ) if hosts.nhosts > 1 else 1
    )
    return Topology(dims, order, bw, lat, tuple(levels), note, adapters)


def network_adapters(transport: str, environ: Mapping[str, str] | None = None) -> int:
    """Network adapters (rails) per host that ``transport`` spreads a host's ranks over, as the
    configuration in ``environ`` sets them (`Transport.rails`: tcp, the interfaces
    ``DDL_SOCKET_IFNAME`` lists; ucx, the devices ``UCX_NET_DEVICES`` lists); 1 for a transport
    that is not installed."""
    if not transport:
        return 1
    from ddlcore import transports
    from ddlcore.errors import TransportUnavailableError
    from ddlcore.transports.base import TransportOptions

    try:
        cls = transports.load(transport)
    except TransportUnavailableError:
        return 1
    return max(1, cls.rails(TransportOptions.from_environ(environ)))
