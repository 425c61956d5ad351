"""Transport choice per pair and the readying of transports before the rendezvous."""

from __future__ import annotations

import ddlcore.transports as transports
import pytest
from ddlcore.transports.base import PeerInfo

from ddlcore.errors import TransportUnavailableError
from ddlcore.job import links


class _Fake:
    """A transport class stand-in that records when it is probed and readied."""

    calls: list[str] = []

    def __init__(self, name: str, ok: bool, ok_once_started: bool = True) -> None:
        self.name, self.ok, self.ok_once_started = name, ok, ok_once_started

    def is_available(self):
        _Fake.calls.append(f"probe {self.name}")
        return self.ok, "" if self.ok else f"{self.name} missing"

    def prepare(self):
        _Fake.calls.append(f"prepare {self.name}")
        self.ok = self.ok_once_started  # what MPI's thread level does once MPI_Init ran


@pytest.fixture
def fakes(monkeypatch):
    table = {
        "mpi": _Fake("mpi", True),
        "shm": _Fake("shm", True),
        "tcp": _Fake("tcp", True),
        "ucx": _Fake("ucx", False),
    }
    _Fake.calls = []
    monkeypatch.setattr(transports, "names", lambda: sorted(table))
    monkeypatch.setattr(transports, "load", lambda name: table[name])
    return table


def test_auto_readies_each_transport_before_probing_the_next(fakes):
    assert links.local_transports("auto") == ("mpi", "shm", "tcp")
    # MPI_Init (mpi's prepare) runs before ucx is probed: ucx must see what MPI loaded. Each is
    # asked again once started.
    assert _Fake.calls[:4] == ["probe mpi", "prepare mpi", "probe mpi", "probe shm"]
    assert "prepare ucx" not in _Fake.calls


def test_forced_transport_is_readied_or_refused_with_the_reason(fakes):
    assert links.local_transports("tcp") == ("tcp",)
    assert _Fake.calls == ["probe tcp", "prepare tcp", "probe tcp"]
    with pytest.raises(
        TransportUnavailableError, match="DDL_TRANSPORT=ucx cannot run here: ucx missing"
    ):
        links.local_transports("ucx")


def test_a_transport_that_cannot_run_once_started_is_dropped_or_refused(fakes):
    fakes["mpi"] = _Fake("mpi", True, ok_once_started=False)
    assert links.local_transports("auto") == ("shm", "tcp")
    fakes["mpi"] = _Fake("mpi", True, ok_once_started=False)
    with pytest.raises(
        TransportUnavailableError, match="DDL_TRANSPORT=mpi cannot run here: mpi missing"
    ):
        links.local_transports("mpi")


def test_auto_takes_shm_within_a_host_and_the_network_order_across():
    class Any_:
        def can_connect(self, me, peer):
            return True

    both = ("mpi", "shm", "tcp")
    instances = {n: Any_() for n in both}
    me = PeerInfo(0, "a", both)
    assert links.choose("auto", me, PeerInfo(1, "a", both), instances) == "shm"
    assert links.choose("auto", me, PeerInfo(1, "b", both), instances) == "mpi"
    assert links.choose("auto:tcp,mpi", me, PeerInfo(1, "b", both), instances) == "tcp"
