"""Rails: with ``DDL_SOCKET_IFNAME`` listing A interfaces, local rank i of the tcp transport
listens on, publishes and sends from the (i mod A)-th.

The selection rule and its errors are checked in this process (``lo`` exists everywhere); that
connections really leave from the rail's address is checked with real rank processes in a
network namespace holding two interfaces (root only, skipped otherwise).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from unittest.mock import patch

import pytest
from ddlcore.transports.sockets import rail_address, rail_interfaces
from ddlcore.transports.tcp import TcpContext

from tests.harness import require


def test_rail_interfaces_parse_the_list():
    assert rail_interfaces("") == () and rail_interfaces(" ") == ()
    assert rail_interfaces("eth0") == ("eth0",)
    assert rail_interfaces("eth0, eth1,eth2") == ("eth0", "eth1", "eth2")
    with pytest.raises(ValueError, match=r"DDL_SOCKET_IFNAME='eth0,' has an empty .*eth0,eth1"):
        rail_interfaces("eth0,")
    with pytest.raises(ValueError, match="names an interface twice"):
        rail_interfaces("lo,eth0,lo")


def test_local_rank_takes_its_rail_mod_the_count():
    assert rail_address("", 3, 1) is None
    # lo is rail 0: local ranks 0, 2, 4 take it and never look the missing rail 1 up
    for local in (0, 2, 4):
        assert rail_address("lo,nosuchif0", 5, local) == "127.0.0.1"
    for local in (1, 3):
        with pytest.raises(ValueError) as info:
            rail_address("lo,nosuchif0", 7, local)
        text = str(info.value)
        assert (
            f"rank 7 (local rank {local}): interface 'nosuchif0', rail 1 of "
            "DDL_SOCKET_IFNAME='lo,nosuchif0'" in text
        ), text
        assert "is not a network interface of this host" in text and "interfaces here:" in text
        assert "list only the adapters all hosts have" in text


def test_one_name_is_every_local_ranks():
    assert {rail_address("lo", 4, local) for local in range(3)} == {"127.0.0.1"}
    with pytest.raises(
        ValueError,
        match=r"^rank 4: DDL_SOCKET_IFNAME='nosuchif0' is not a "
        r"network interface of this host .*interfaces here",
    ):
        rail_address("nosuchif0", 4, 3)


def _context(ifname: str, local_rank: int) -> TcpContext:
    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 2.0, rank=0, size=2)
    try:
        with patch.dict("os.environ", {"DDL_SOCKET_IFNAME": ifname}):
            ctx = TcpContext(0, 2, PrefixStore(client, "t/"), 2.0, local_rank)
        ctx.close()
        return ctx
    finally:
        client.close()
        server.close()


def test_tcp_context_listens_on_its_rail():
    assert _context("lo", 1).address == "127.0.0.1"  # one name: every local rank's
    assert _context("lo,nosuchif0", 2).address == "127.0.0.1"
    with pytest.raises(ValueError, match=r"rank 0 \(local rank 1\): interface 'nosuchif0'"):
        _context("lo,nosuchif0", 1)


def test_ucx_local_rank_takes_its_net_device():
    from ddlcore.transports.ucx import net_device_rails, ucx_options

    env = {"UCX_NET_DEVICES": "mlx5_0:1, mlx5_1:1"}
    assert net_device_rails(env) == ("mlx5_0:1", "mlx5_1:1")
    assert [ucx_options(env, i)["NET_DEVICES"] for i in range(4)] == ["mlx5_0:1", "mlx5_1:1"] * 2
    for one in ({}, {"UCX_NET_DEVICES": "all"}, {"UCX_NET_DEVICES": "mlx5_0:1"}):
        assert "NET_DEVICES" not in ucx_options(one, 1)  # UCX's own choice, or the user's one


def test_ucx_context_is_given_its_rails_device():
    from ddlcore.transports import ucx

    require(*ucx.UcxTransport.is_available())
    lib, _ = ucx._import_ucxx()
    with patch.dict("os.environ", {"UCX_NET_DEVICES": "lo,nosuchdev0"}):
        # local rank 2 takes rail 0 alone: UCX never sees the missing rail 1
        context = lib.UCXContext(ucx.ucx_options(local_rank=2), ucx._features(lib))
    assert context.config["NET_DEVICES"] == "lo"


# --- real ranks in a namespace with two rails ------------------------------------------------

_RANK = textwrap.dedent("""
    import sys, numpy as np
    from ddlcore.job.store import PrefixStore, StoreClient
    from ddlcore.transports.tcp import TcpTransport
    rank, local = int(sys.argv[1]), int(sys.argv[2])
    client = StoreClient("127.0.0.1", int(sys.argv[3]), 20.0, rank=rank, size=2)
    store = PrefixStore(client, "j/")
    ctx = TcpTransport().create_context_local(rank, 2, store, 20.0, local)
    pair = ctx.pair(1 - rank)
    buf = np.arange(1000, dtype=np.int64) * (rank + 1)
    got = np.empty_like(buf)
    r = pair.irecv(memoryview(got).cast("B"), 7)
    pair.isend(memoryview(buf).cast("B"), 7).wait(20)
    r.wait(20)
    assert (got == np.arange(1000) * (2 - rank)).all()
    socks = [ch.sock for ch in pair._channels]
    print(rank, ctx.address, ",".join(f"{s.getsockname()[0]}>{s.getpeername()[0]}" for s in socks))
    sys.stdout.flush()
    client.barrier("done", timeout=20.0)
    ctx.close()
    client.close()
""")


def _netns_ok() -> tuple[bool, str]:
    if os.geteuid() != 0:
        return False, "network namespaces need root"
    if shutil.which("ip") is None:
        return False, "iproute2 (ip) is not installed"
    return True, ""


def test_each_rank_listens_on_its_rails_address(tmp_path):
    require(*_netns_ok())
    ns = f"ddlrails-{os.getpid()}"
    ip = ["ip", "-n", ns]
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True)
    try:
        subprocess.run(ip + ["link", "set", "lo", "up"], check=True)
        for rail in (0, 1):
            # a veth pair with both ends here: an interface with an address (no dummy module)
            subprocess.run(
                ip + ["link", "add", f"rail{rail}", "type", "veth", "peer", "name", f"rail{rail}p"],
                check=True,
            )
            subprocess.run(
                ip + ["addr", "add", f"10.214.{rail}.1/24", "dev", f"rail{rail}"], check=True
            )
            for dev in (f"rail{rail}", f"rail{rail}p"):
                subprocess.run(ip + ["link", "set", dev, "up"], check=True)
        script = tmp_path / "rank.py"
        script.write_text(_RANK)
        outs = _run_pair(ns, script, tmp_path)
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    # rank 0 (local rank 0) listens on rail0; it connects (lower rank) to rank 1's rail1
    # address, from wherever the kernel routes it (no source bound)
    rank0, rank1 = outs[0].split(), outs[1].split()
    assert rank0[:2] == ["0", "10.214.0.1"] and rank0[2].endswith(">10.214.1.1"), outs
    assert rank1[:2] == ["1", "10.214.1.1"] and rank1[2].startswith("10.214.1.1>"), outs


def _run_pair(ns: str, script, tmp_path) -> list[str]:
    """Serve a store in the namespace, run ranks 0 and 1 as local ranks 0 and 1 there."""
    code = textwrap.dedent(f"""
        import subprocess, sys
        from ddlcore.job.store import StoreServer
        server = StoreServer("127.0.0.1", 0)
        env = dict(__import__("os").environ, DDL_SOCKET_IFNAME="rail0,rail1")
        procs = [subprocess.Popen([sys.executable, {str(script)!r}, str(r), str(r),
                                   str(server.port)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        try:
            outs = [p.communicate(timeout=40)[0] for p in procs]
        finally:
            for p in procs:
                p.kill()
        server.close()
        for p, out in zip(procs, outs):
            print(f"{{p.returncode}}|{{out.strip().splitlines()[-1] if out.strip() else ''}}")
            if p.returncode:
                print(out, file=sys.stderr)
    """)
    res = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.getcwd(),
    )
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and len(lines) == 2, res.stdout + res.stderr
    assert all(line.startswith("0|") for line in lines), res.stdout + res.stderr
    return [line[2:] for line in lines]
