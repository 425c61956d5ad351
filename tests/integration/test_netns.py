"""Collectives across emulated hosts: 2 network namespaces x 2 ranks, every registered algorithm,
ranks placed host by host and dealt round-robin over the namespaces (cyclic).

Uses the testbed of ``benchmarks/netns_testbed.py`` (loaded by path: ``benchmarks`` is not a
package). Ranks in one namespace must talk over shm and across namespaces over tcp, results must
match NumPy on every rank, and nothing (namespaces, links, /dev/shm segments, processes) may be
left behind, also when a rank fails. A host cut off (its link down: a real partition) leaves
only the larger side going on. Needs root and iproute2; CI runs it as root.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import time

import pytest

from ddlcore.algorithms import ALGORITHMS
from tests.harness import require

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).parent / "scripts" / "netns_collectives.py"
RANKS_PER_HOST, HOSTS = 2, 2


def _testbed():
    path = ROOT / "benchmarks" / "netns_testbed.py"
    spec = importlib.util.spec_from_file_location("netns_testbed", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("netns_testbed", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def netns():
    module = _testbed()
    ok, why = module.netns_available()
    require(ok, why)
    return module


@pytest.mark.parametrize("algo", sorted(ALGORITHMS["allreduce"]))
def test_collectives_across_namespaces(netns, algo):
    # Unshaped: this checks correctness; speed is the benchmark's business.
    with netns.Testbed(HOSTS) as tb:
        ranks = tb.run_job(
            RANKS_PER_HOST,
            [str(WORKER), str(RANKS_PER_HOST)],
            timeout=45,
            env={"DDL_ALGO": algo, "DDL_TRANSPORT": "auto:tcp"},
            ddl_timeout=30,
        )
        lines = sorted(r.output().strip() for r in ranks)
    assert lines == [
        f"rank {r} on host {r // RANKS_PER_HOST}: {algo} ok, transports ['shm', 'tcp']"
        for r in range(HOSTS * RANKS_PER_HOST)
    ], lines
    assert tb.leftovers() == []


def test_failing_rank_stops_the_job_and_nothing_is_left(netns, tmp_path):
    # Rank 1 fails at once; the others would sleep far past the job's timeout.
    code = "import os, sys, time; os.environ['DDL_RANK'] == '1' and sys.exit(3); time.sleep(60)"
    with netns.Testbed(HOSTS, rate="1gbit", workdir=str(tmp_path)) as tb:
        with pytest.raises(
            netns.JobFailed, match=r"ranks \[1\] failed; ranks \[0, 2, 3\] still running"
        ) as info:
            tb.run_job(RANKS_PER_HOST, ["-c", code], timeout=30)
    assert "rank 1 (host 0, exit 3)" in str(info.value)
    assert tb.leftovers() == []


def test_job_timeout_kills_every_rank(netns, tmp_path):
    with netns.Testbed(HOSTS, workdir=str(tmp_path)) as tb:
        with pytest.raises(
            netns.JobFailed, match=r"^ranks \[0, 1\] still running after the job's 1 s"
        ):
            tb.run_job(1, ["-c", "import time; time.sleep(60)"], timeout=1)
        assert all(r.proc.poll() is not None for r in tb.ranks)
    assert tb.leftovers() == []


def test_placements_deal_ranks_to_hosts():
    tb = _testbed()
    assert [tb.host_of(r, 2, 3, "block") for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert [tb.host_of(r, 2, 3, "cyclic") for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert tb.box_order(2, 3, "cyclic") == [0, 3, 1, 4, 2, 5]
    # The rank-order ring leaves each host once (block) or from every rank on it (cyclic).
    assert [tb.ring_flows(m, h, "block") for m, h in [(2, 2), (2, 3), (4, 2), (4, 1)]] == [
        1,
        1,
        1,
        0,
    ]
    assert [tb.ring_flows(m, h, "cyclic") for m, h in [(2, 2), (2, 3), (4, 2)]] == [2, 2, 4]
    with pytest.raises(ValueError, match="placement 'round'"):
        tb.host_of(0, 2, 2, "round")
    # The simulator sees the same rank -> host map: the ring pays for its M flows per link.
    ring = [tb.simulated(2, 2, p, "1gbit", "ring", 16 << 20) for p in ("block", "cyclic")]
    assert ring[1] == pytest.approx(2 * ring[0], rel=0.05)
    md = [tb.simulated(2, 2, p, "1gbit", "mdring", 16 << 20) for p in ("block", "cyclic")]
    assert md[0] == pytest.approx(md[1], rel=1e-6) and md[1] < ring[1] / 2.5
    assert tb.simulated(2, 2, "cyclic", None, "ring", 1 << 20) is None


@pytest.mark.parametrize("algo", ["ring", "mdring", "auto"])
def test_cyclic_placement_across_namespaces(netns, algo, tmp_path):
    """Rank r in namespace r % 2: the box follows the namespaces (order 0, 2, 1, 3), shm among
    the ranks of one, tcp across, and the testbed's worker gets exact sums."""
    out = tmp_path / "rows.json"
    argv = [
        str(ROOT / "benchmarks" / "netns_testbed.py"),
        "--rank-worker",
        "4,4000012",
        "2",
        "1",
        str(out),
    ]
    with netns.Testbed(HOSTS) as tb:
        ranks = tb.run_job(
            RANKS_PER_HOST,
            argv,
            timeout=60,
            placement="cyclic",
            ddl_timeout=30,
            env={"DDL_ALGO": algo, "DDL_TRANSPORT": "auto:tcp"},
        )
        assert [r.host for r in ranks] == [r % HOSTS for r in range(HOSTS * RANKS_PER_HOST)]
    assert tb.leftovers() == []
    got = json.loads(out.read_text())
    assert got["order"] == [0, 2, 1, 3] and got["box"] == "2x2" and got["nhosts"] == HOSTS
    assert got["transports"] == ["shm", "tcp"]
    assert [row["wrong"] for row in got["rows"]] == [0, 0]
    assert (
        got["algorithm"] == algo if algo != "auto" else got["algorithm"] in ALGORITHMS["allreduce"]
    )


def _tx_bytes(ns: str, dev: str) -> int:
    import subprocess

    out = subprocess.run(
        ["ip", "-n", ns, "-j", "-s", "link", "show", "dev", dev],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    ).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def test_two_adapters_per_host_both_carry_traffic(netns, tmp_path):
    """--adapters 2: each host has eth0 and eth1 (own bridge, own subnet), DDL_SOCKET_IFNAME
    lists both, so local rank i's cross-host ring sends through eth(i mod 2): both rails of
    every host carry about half of the job's bytes, and the topology knows 2 adapters."""
    nbytes, iters = 4 << 20, 2
    out = tmp_path / "rows.json"
    argv = [
        str(ROOT / "benchmarks" / "netns_testbed.py"),
        "--rank-worker",
        str(nbytes),
        str(iters),
        "1",
        str(out),
    ]
    with netns.Testbed(HOSTS, adapters=2) as tb:
        assert tb.ifnames == ["eth0", "eth1"]
        before = {(h, d): _tx_bytes(tb.namespace(h), d) for h in range(HOSTS) for d in tb.ifnames}
        # No link probe: its messages cross rail 0 alone; the counters weigh the collective.
        tb.run_job(
            RANKS_PER_HOST,
            argv,
            timeout=60,
            ddl_timeout=30,
            env={"DDL_ALGO": "mdring", "DDL_TRANSPORT": "auto:tcp", "DDL_LINK_PROBE": "0"},
        )
        sent = {k: _tx_bytes(tb.namespace(k[0]), k[1]) - v for k, v in before.items()}
    assert tb.leftovers() == []
    got = json.loads(out.read_text())
    assert got["adapters"] == 2 and got["box"] == "2x2" and got["transports"] == ["shm", "tcp"]
    assert [row["wrong"] for row in got["rows"]] == [0]
    # Each local rank's ring moves its half of the buffer: (iters + warm-up) x 2(H-1)/H x n/2.
    share = (iters + 1) * nbytes / 2
    for (h, dev), n in sent.items():
        assert 0.8 * share < n < 2 * share, (h, dev, n, sent)


def test_simulator_column_counts_the_adapters():
    tb = _testbed()
    one, two = (
        tb.simulated(4, 2, "block", "1gbit", "mdring", 64 << 20, adapters=a) for a in (1, 2)
    )
    assert two == pytest.approx(one / 2, rel=0.1)
    # --transport tcp: the host level is TCP loopback, slower than the boards' shm
    assert (
        tb.simulated(4, 2, "block", "1gbit", "mdring", 64 << 20, adapters=2, host_transport="tcp")
        > two
    )


PARTITION = pathlib.Path(__file__).parent / "scripts" / "netns_partition.py"


def _lines(rank) -> list[str]:
    return [line for line in pathlib.Path(rank.out).read_text().splitlines() if line]


@pytest.mark.parametrize(
    "hosts, cut, goes_on",
    [(3, 2, [0, 1]), (2, 1, [0]), (2, 0, [0])],
    ids=["one-of-three-cut-off", "two-halves-rank-1-cut-off", "two-halves-rank-0-cut-off"],
)
def test_a_partition_leaves_one_side_going_on(netns, tmp_path, hosts, cut, goes_on):
    """A host's link goes down (its connections stay open, nothing arrives: a real partition,
    not a death). Each side finds the other by the heartbeat's silence; only the side with more
    than half of the ranks, or half with rank 0, goes on; the other stops with ExcludedError:
    never two communicators. Of two halves, rank 0's goes on, whichever host was cut off."""
    with netns.Testbed(hosts, workdir=str(tmp_path)) as tb:
        ranks = tb.launch(1, [str(PARTITION)], str(tmp_path), ddl_timeout=60)
        try:
            deadline = time.monotonic() + 60
            while not all(_lines(r)[:1] == ["ready"] for r in ranks):
                assert time.monotonic() < deadline, [r.output() for r in ranks]
                assert all(r.proc.poll() is None for r in ranks), [r.output() for r in ranks]
                time.sleep(0.05)
            # The switch's end of the host's link: down, the host's end stays up.
            subprocess.run(["ip", "-n", tb.switch, "link", "set", f"h{cut}", "down"], check=True)
            for r in ranks:
                r.proc.wait(timeout=60)
            outcomes = {r.rank: _lines(r)[-1] for r in ranks}
        finally:
            netns.kill(ranks)
        for rank, line in outcomes.items():
            if rank in goes_on:
                assert line == f"went on: {len(goes_on)} {goes_on} True", outcomes
            else:
                assert line.startswith("stopped: ExcludedError"), outcomes
    assert tb.leftovers() == []
