"""Options reach a transport as a value (`TransportOptions`), built once from the configuration
that ``ddlcore.init(environ=...)`` is given; plug-ins of transport API version 1 still load."""

from __future__ import annotations

import os

import ddlcore.transports as transports
import numpy as np
import pytest
from ddlcore.transports.base import Context, PeerInfo, Store, Transport, TransportOptions

from ddlcore.errors import TransportUnavailableError
from tests.harness import run_ranks


def test_options_are_read_from_the_mapping_given():
    env = {
        "DDL_NCHANNELS": "3",
        "DDL_SOCKET_IFNAME": "lo",
        "DDL_GPU_DIRECT": "off",
        "PMI_RANK": "0",
        "UCX_TLS": "tcp",
        "HOME": "/nowhere",
    }
    options = TransportOptions.from_environ(env, local_rank=2)
    assert options == TransportOptions(3, "lo", "off", 2, True, {"UCX_TLS": "tcp"})
    assert TransportOptions.from_environ({}) == TransportOptions()


def test_the_mpi_transport_asks_its_options_whether_a_launcher_started_it():
    from ddlcore.transports.mpi import MpiTransport

    ok, why = MpiTransport.is_available(TransportOptions(mpi_launched=False))
    assert not ok and "MPI launcher" in why


def _channels(rank: int, size: int) -> tuple[int, float]:
    import ddlcore

    env = dict(os.environ, DDL_NCHANNELS="3", DDL_TRANSPORT="tcp")
    with ddlcore.init(environ=env) as comm:
        assert "DDL_NCHANNELS" not in os.environ
        total = comm.allreduce(np.full(1000, rank + 1.0))
        return comm._links.contexts["tcp"].nchannels, float(total[0])


def test_init_environ_reaches_the_transports():
    assert run_ranks(_channels, 2, timeout=60) == [(3, 3.0), (3, 3.0)]


class _Old(Transport):
    """A plug-in written for transport API version 1: no options anywhere."""

    name = "old"
    api_version = 1
    made: list[tuple] = []

    @classmethod
    def is_available(cls) -> tuple[bool, str]:  # type: ignore[override]
        return True, "asked without options"

    def can_connect(self, me: PeerInfo, peer: PeerInfo) -> bool:
        return True

    def create_context(self, rank: int, size: int, store: Store, timeout: float) -> Context:  # type: ignore[override]
        _Old.made.append((rank, size, timeout))
        return None  # type: ignore[return-value]


class _Confused(_Old):
    """Version 2 inherited from the base class, version 1's create_context."""

    api_version = 2


def test_a_version_1_plug_in_is_called_the_old_way(monkeypatch):
    monkeypatch.setattr(transports, "_entry_points", lambda: {"old": f"{__name__}:_Old"})
    cls = transports.load("old")
    assert transports.is_available(cls, TransportOptions()) == (True, "asked without options")
    _Old.made = []
    transports.create_context(cls(), 1, 2, None, 5.0, TransportOptions(local_rank=1))  # type: ignore[arg-type]
    assert _Old.made == [(1, 2, 5.0)]


def test_a_plug_in_that_takes_no_options_under_version_2_is_refused(monkeypatch):
    monkeypatch.setattr(transports, "_entry_points", lambda: {"bad": f"{__name__}:_Confused"})
    with pytest.raises(TransportUnavailableError, match="set api_version = 1"):
        transports.load("bad")


def test_only_shm_offers_host_collectives():
    from ddlcore.transports.shm import ShmTransport
    from ddlcore.transports.shm.boards import MAX_RANKS, HostCollectives
    from ddlcore.transports.tcp import TcpTransport

    from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

    server = StoreServer("127.0.0.1", 0)
    client = StoreClient("127.0.0.1", server.port, 2.0, rank=0, size=2)
    try:
        for transport, offer in ((ShmTransport(), HostCollectives), (TcpTransport(), None)):
            ctx = transport.create_context(0, 2, PrefixStore(client, "t/"), 2.0, TransportOptions())
            try:
                assert ctx.host_collectives() is offer
            finally:
                ctx.close()
        assert HostCollectives.max_ranks == MAX_RANKS
    finally:
        client.close()
        server.close()
