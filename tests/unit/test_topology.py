"""Topology: the box derived from host (and rack) identities or given, its placement of ranks,
its links, and the errors a box that does not fit the job gives."""

from __future__ import annotations

import pytest

from ddlcore import topology


def _build(hosts, racks=None, env=None, transports=None):
    return topology.build(
        hosts,
        racks or [""] * len(hosts),
        transports or {"host": "shm", "network": "tcp"},
        env or {},
    )


def test_ranks_per_host_times_hosts():
    topo = _build(["a", "a", "b", "b", "c", "c"])
    assert topo.dims == (2, 3) and topo.levels == ("host", "network")
    assert topo.bw == (topology.LINK_DEFAULTS["shm"][0], topology.LINK_DEFAULTS["tcp"][0])
    assert topo.ring_along(0, 1) == (0, 2, 4) and topo.ring_along(3, 0) == (2, 3)
    assert topo.dim_between(0, 1) == 0 and topo.dim_between(1, 4) == 1
    assert topo.host_dims == 1 and topo.ranks_per_node == 2 and topo.node_of(5) == 2


def test_interleaved_hosts_are_placed_host_by_host():
    topo = _build(["a", "b", "a", "b"])
    assert topo.order == (0, 2, 1, 3)
    assert topo.coords(2) == (1, 0) and topo.coords(1) == (0, 1)
    assert topo.rank_at((1, 1)) == 3


def test_racks_add_a_level():
    hosts = [f"h{r // 2}" for r in range(8)]
    racks = [f"r{r // 4}" for r in range(8)]
    topo = _build(hosts, racks)
    assert topo.dims == (2, 2, 2) and topo.levels == ("host", "rack", "cross-rack")


def test_uneven_hosts_fall_back_to_a_flat_ring_that_says_why():
    topo = _build(["a", "a", "a", "b", "b"])
    assert topo.dims == (5,)
    assert "3, 2" in topo.note and "flat" in topo.note
    assert topo.order == (0, 1, 2, 3, 4)


def test_given_box_refines_the_hosts():
    topo = _build(["a"] * 4 + ["b"] * 4, env={"DDL_TOPOLOGY": "2x2x2"})
    assert topo.dims == (2, 2, 2) and topo.levels == ("host", "host", "network")
    assert topo.ranks_per_node == 4


@pytest.mark.parametrize(
    "shape,hosts,match",
    [
        ("4x2", ["a"] * 6, "holds 8 ranks but the job has 6"),
        ("4x2", ["a"] * 2 + ["b"] * 6, r"\[2, 6\] ranks"),
        ("8x2", ["a"] * 4 + ["b"] * 4 + ["c"] * 4 + ["d"] * 4, "splits a host"),
        ("3x2", ["a"] * 2 + ["b"] * 2 + ["c"] * 2, "splits a host"),
    ],
)
def test_a_box_that_does_not_fit_says_what_was_found(shape, hosts, match):
    with pytest.raises(ValueError, match=match) as info:
        _build(hosts, env={"DDL_TOPOLOGY": shape})
    assert "DDL_TOPOLOGY" in str(info.value)


def test_link_overrides_per_dimension():
    topo = _build(
        ["a"] * 4, env={"DDL_TOPOLOGY": "2x2", "DDL_LINK_BW": "20e9,10e9", "DDL_LINK_LAT": "1e-6"}
    )
    assert topo.bw == (20e9, 10e9) and topo.lat == (1e-6, 1e-6)
    with pytest.raises(ValueError, match="DDL_LINK_BW: 3 values for a box of 2"):
        _build(["a"] * 4, env={"DDL_TOPOLOGY": "2x2", "DDL_LINK_BW": "1,2,3"})
    with pytest.raises(ValueError, match="DDL_LINK_BW"):
        _build(["a"] * 4, env={"DDL_LINK_BW": "fast"})


def test_short_link_lists_repeat_the_slowest():
    assert topology.per_dim([20e9, 10e9], 3, "x") == (20e9, 10e9, 10e9)


def test_box_rejects_a_wrong_order():
    with pytest.raises(ValueError, match="does not hold"):
        topology.Topology((2, 2), (0, 1, 2, 2), (1.0,) * 2, (1.0,) * 2, ("host", "network"))


def test_adapters_share_the_network_round_robin():
    topo = topology.box((4, 2), [1e9, 1e9], [1e-6, 1e-6], adapters=2)
    assert [topo.adapter_of(r) for r in range(4)] == [(0, 0), (0, 1), (0, 0), (0, 1)]
    assert topo.adapter_of(5) == (1, 1)


# --- cyclic placement: ranks dealt round-robin over the hosts (rank r on host r % H) ------------


def _cyclic(per_host, hosts):
    return [f"h{r % hosts}" for r in range(per_host * hosts)]


@pytest.mark.parametrize(
    "per_host,hosts,order",
    [
        (2, 2, (0, 2, 1, 3)),
        (2, 3, (0, 3, 1, 4, 2, 5)),
        (4, 2, (0, 2, 4, 6, 1, 3, 5, 7)),
        (3, 2, (0, 2, 4, 1, 3, 5)),
    ],
)
def test_cyclic_placement_makes_the_same_box_permuted(per_host, hosts, order):
    """The box comes from the host grouping, not from rank numbers: each host's ranks form the
    fast dimension (by rank), the hosts the slow one (by their lowest rank)."""
    topo = _build(_cyclic(per_host, hosts))
    assert topo.dims == (per_host, hosts) and topo.levels == ("host", "network")
    assert topo.order == order
    for r in range(topo.size):
        host = r % hosts
        assert topo.coords(r) == (r // hosts, host)
        assert topo.rank_at(topo.coords(r)) == r
        assert topo.node_of(r) == host and topo.adapter_of(r) == (host, 0)
        assert topo.ring_along(r, 0) == tuple(range(host, topo.size, hosts))  # its host
        assert topo.ring_along(r, 1) == tuple(range(r - host, r - host + hosts))  # across
        for q in range(topo.size):
            assert topo.dim_between(r, q) == (-1 if q == r else 0 if q % hosts == host else 1)
    assert "" == topo.note


def test_cyclic_placement_with_a_given_box_and_racks():
    topo = _build(_cyclic(2, 2), env={"DDL_TOPOLOGY": "2x2"})
    assert topo.dims == (2, 2) and topo.order == (0, 2, 1, 3)
    with pytest.raises(ValueError, match="splits a host"):
        _build(_cyclic(2, 2), env={"DDL_TOPOLOGY": "4x1"})
    # Hosts dealt round-robin too, racks grouping hosts 0, 1 and 2, 3: the box is still
    # host x rack x racks, each rack's hosts in it by their lowest rank.
    hosts = _cyclic(2, 4)
    racks = [f"r{r % 4 // 2}" for r in range(8)]
    topo = _build(hosts, racks)
    assert topo.dims == (2, 2, 2) and topo.levels == ("host", "rack", "cross-rack")
    assert topo.order == (0, 4, 1, 5, 2, 6, 3, 7)
    assert topo.dim_between(0, 4) == 0 and topo.dim_between(0, 1) == 1
    assert topo.dim_between(0, 2) == 2


def test_uneven_cyclic_hosts_keep_the_hosts_together_in_the_flat_box():
    topo = _build(["a", "b", "a", "b", "a"])
    assert topo.dims == (5,) and topo.order == (0, 2, 4, 1, 3) and "[3, 2]" in topo.note


@pytest.mark.parametrize("host", sorted(topology.LINK_DEFAULTS))
@pytest.mark.parametrize("network", sorted(topology.LINK_DEFAULTS))
def test_default_network_is_never_faster_than_the_host(host, network):
    """Until a probe measures them, a level across hosts is priced below the in-host level of
    the same job, whatever carries either (ucx's 12.5 GB/s put the network first: issue 21)."""
    hosts = [f"h{r // 2}" for r in range(8)]
    for racks in (None, [f"r{r // 4}" for r in range(8)]):
        topo = _build(hosts, racks, transports={"host": host, "network": network})
        assert topo.levels[0] == "host" and len(topo.levels) > 1
        for j in range(1, len(topo.dims)):
            assert topo.bw[j] <= topo.bw[0] / topology.NETWORK_SLOWER < topo.bw[0]
            assert topo.lat[j] >= topo.lat[0]
    # One rank per host: no in-host level to compare with, the network's own defaults.
    flat = _build(["a", "b"], transports={"host": "shm", "network": "ucx"})
    assert flat.bw == (topology.LINK_DEFAULTS["ucx"][0],)


def test_default_links_make_auto_go_host_first():
    """With the defaults, a 2-host job's allreduce runs mdring with the host dimension first,
    the order that stays near the bound on a slow network (issue 21)."""
    from ddlcore.planning import tuning

    for per_host in (2, 4):
        hosts = [f"h{r // per_host}" for r in range(2 * per_host)]
        topo = _build(hosts, transports={"host": "shm", "network": "ucx"})
        for nbytes in (16 << 20, 64 << 20):
            choice = tuning.choose("allreduce", topo, nbytes, "auto", 1 << 20, False)
            assert choice.algorithm == "mdring" and choice.dim_order == (0, 1), choice
    # Given links still win.
    fast = _build(
        ["a", "a", "b", "b"],
        env={"DDL_LINK_BW": "5e9,12.5e9"},
        transports={"host": "shm", "network": "ucx"},
    )
    assert fast.bw == (5e9, 12.5e9)


def _probe_rounds(first_slow_s=0.0, noise_s=0.0, seed=0):
    """`probe.next_step` and `probe.rate` against a tbf-shaped 1 Gbit/s link (125 MB/s, a
    128 KiB burst passed at once every round, 100 us of latency): (reading, sizes run)."""
    import random

    from ddlcore.job import probe

    bw, lat, burst, rnd = 125e6, 100e-6, 128 << 10, random.Random(seed)
    nbytes, rounds, trips, sizes = probe._BW_FIRST, 1, [], []
    while rounds:
        for _ in range(rounds):
            slow = first_slow_s if not sizes else 0.0
            trips.append(2 * lat + max(nbytes - burst, 0) / bw + slow + rnd.random() * noise_s)
        sizes.append(nbytes)
        nbytes, rounds, trips = probe.next_step(nbytes, trips)
    return probe.rate(nbytes, trips), sizes


def test_the_link_probe_reads_a_shaped_link_past_its_burst_and_never_high():
    from ddlcore.job import probe

    bw, burst = 125e6, 128 << 10
    most = bw * (1 + burst / (bw * probe._BW_TARGET_S))  # a burst in every round, no more
    got, sizes = _probe_rounds()
    assert 0.95 * bw < got < most
    assert sizes == [256 << 10, 4 << 20, 4 << 20]  # a jump to the target, then two more rounds
    # Load only lengthens rounds: any reading under it is below the quiet one's bound.
    for seed in range(200):
        assert _probe_rounds(noise_s=0.03, seed=seed)[0] < most
    # A first round slowed by load makes the next jump short; the message grows on to the target.
    got, sizes = _probe_rounds(first_slow_s=0.01)
    assert sizes[-1] == 4 << 20 and 0.95 * bw < got < most


# --- network adapters (rails): DDL_SOCKET_IFNAME's list, as the tcp transport uses it ----------


@pytest.mark.parametrize(
    "ifname, hosts, network, adapters",
    [
        ("eth0,eth1", ["a", "a", "b", "b"], "tcp", 2),
        ("eth0, eth1, eth2", ["a", "a", "b", "b"], "tcp", 3),
        ("eth0", ["a", "a", "b", "b"], "tcp", 1),
        ("", ["a", "a", "b", "b"], "tcp", 1),
        ("eth0,eth1", ["a", "a", "a", "a"], "tcp", 1),  # one host: no network to share
        ("eth0,eth1", ["a", "a", "b", "b"], "ucx", 1),  # the list is tcp's
        ("ucx:mlx5_0:1,mlx5_1:1", ["a", "a", "b", "b"], "ucx", 2),
        ("ucx:all", ["a", "a", "b", "b"], "ucx", 1),
        ("ucx:mlx5_0:1,mlx5_1:1", ["a", "a", "b", "b"], "tcp", 1),
    ],
)
def test_adapters_are_the_rails_listed(ifname, hosts, network, adapters):
    env = (
        {"UCX_NET_DEVICES": ifname[4:]}
        if ifname.startswith("ucx:")
        else {"DDL_SOCKET_IFNAME": ifname}
    )
    topo = _build(hosts, env=env, transports={"host": "shm", "network": network})
    assert topo.adapters == adapters
    assert ("network adapters per host" in topo.describe()) == (adapters > 1)


@pytest.mark.parametrize(
    "hosts",
    [
        ["a"] * 4 + ["b"] * 4,  # block
        ["a", "b"] * 4,  # cyclic
        ["a", "a", "b", "b", "c", "c"],
    ],
)
@pytest.mark.parametrize("rails", ["eth0,eth1", "eth0,eth1,eth2"])
def test_adapter_of_is_the_engines_local_rank_mod_rails(hosts, rails):
    topo = _build(hosts, env={"DDL_SOCKET_IFNAME": rails})
    a = len(rails.split(","))
    for rank in range(len(hosts)):
        here = topology.layout(hosts, rank)
        assert topo.adapter_of(rank) == (topo.node_of(rank), here.local_rank % a), rank
        assert topo.node_of(rank) == here.host_of[rank]


def test_two_rails_halve_the_predicted_network_time():
    from ddlcore.planning import tuning

    hosts = ["a"] * 4 + ["b"] * 4
    one, two = (
        _build(hosts, env={"DDL_SOCKET_IFNAME": f, "DDL_LINK_BW": "5e9,125e6"})
        for f in ("eth0", "eth0,eth1")
    )
    cost = [tuning.predict("allreduce", "mdring", t, 64 << 20) for t in (one, two)]
    assert cost[1] < 0.6 * cost[0], cost


def test_bad_socket_ifname_list_is_named():
    with pytest.raises(ValueError, match="DDL_SOCKET_IFNAME='eth0,,eth1' has an empty"):
        _build(["a", "b"], env={"DDL_SOCKET_IFNAME": "eth0,,eth1"})
    with pytest.raises(ValueError, match="names an interface twice"):
        _build(["a", "b"], env={"DDL_SOCKET_IFNAME": "eth0,eth0"})


def test_tcp_inside_a_host_runs_at_a_cpus_share():
    """Loopback TCP is the kernel's copies on the machine's CPUs: ranks that outnumber them
    each get their share; shared memory and the network keep their defaults."""
    hosts = ["a"] * 4 + ["b"] * 4
    tcp = {"host": "tcp", "network": "tcp"}
    full = topology.build(hosts, [""] * 8, tcp, {})
    crowded = topology.build(hosts, [""] * 8, tcp, {}, cpu_share=0.25)
    assert crowded.bw[0] == pytest.approx(full.bw[0] / 4)
    # Until a probe measures it, the network stays priced below the host (its bytes cross the
    # same CPUs).
    assert crowded.bw[1] == pytest.approx(crowded.bw[0] / topology.NETWORK_SLOWER)
    assert full.bw[0] == topology.LINK_DEFAULTS["tcp"][0]
    assert topology.build(hosts, [""] * 8, tcp, {}, cpu_share=3.0).bw == full.bw
    shm = topology.build(hosts, [""] * 8, {"host": "shm", "network": "tcp"}, {}, cpu_share=0.25)
    assert shm.bw[0] == topology.LINK_DEFAULTS["shm"][0]
