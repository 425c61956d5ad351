"""The failure detector's heartbeat (``ddl_heartbeat.h`` under `ControlPlane.watch`), planes in
one process and raw UDP sockets as peers: a live plane is never called silent, one that says
nothing (or only things without the job's token) is, once, within the timeout; a plane that
closes says goodbye and is not; a peer found silent that speaks again is answered FENCED; a
plane told FENCED tells its watchers and its agreements refuse to decide."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from ddlcore.errors import ExcludedError
from ddlcore.resilience.channel import AgreeChannel
from ddlcore.resilience.control import SILENT, ControlPlane
from ddlcore.security.auth import JobKey

HEARTBEAT_S = 0.3
PACKET = struct.Struct("<II8s")
MAGIC, PING, PONG, FENCED = 0xDDC7BEA7, 1, 2, 4


def _key() -> JobKey:
    key = JobKey(b"s" * 32, "1234", "a test")
    key.job_id = b"j" * 16
    return key


def _token(key: JobKey) -> bytes:
    return key.derive(b"heartbeat", key.job_id or b"")[:8]


class Watcher:
    def __init__(self) -> None:
        self.silent: list = []
        self.fenced: list = []
        self.cond = threading.Condition()

    def on_silent(self, peer):
        with self.cond:
            self.silent.append(peer)
            self.cond.notify_all()

    def on_fenced(self, peer):
        with self.cond:
            self.fenced.append(peer)
            self.cond.notify_all()

    def wait(self, what: str, timeout: float = 10.0) -> list:
        with self.cond:
            self.cond.wait_for(lambda: getattr(self, what), timeout)
            return list(getattr(self, what))


@pytest.fixture
def planes():
    made: list[ControlPlane] = []

    def make() -> ControlPlane:
        plane = ControlPlane("127.0.0.1", _key(), timeout=5.0, heartbeat_s=HEARTBEAT_S)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.close()


@pytest.fixture
def mute():
    """A UDP socket that answers nothing: a stopped process's heartbeat port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5.0)
    yield sock
    sock.close()


def test_a_live_plane_is_never_silent(planes):
    a, b = planes(), planes()
    watcher = Watcher()
    stop = a.watch([b.address], watcher)
    time.sleep(5 * HEARTBEAT_S)
    stop()
    assert watcher.silent == [] and not a.lost(b.address)


def test_a_mute_peer_is_silent_once_within_the_timeout(planes, mute):
    a = planes()
    peer = mute.getsockname()
    watcher = Watcher()
    t0 = time.monotonic()
    a.watch([peer], watcher)
    assert watcher.wait("silent") == [peer]
    elapsed = time.monotonic() - t0
    assert HEARTBEAT_S * 0.9 <= elapsed < 10.0, elapsed
    assert a.how_lost(peer) == SILENT
    time.sleep(2 * HEARTBEAT_S)
    assert watcher.silent == [peer]  # once
    # Pinged meanwhile: the plane tried to hear it.
    data, _ = mute.recvfrom(64)
    magic, kind, token = PACKET.unpack(data)
    assert (magic, kind, token) == (MAGIC, PING, _token(_key()))


def test_packets_without_the_token_are_not_heard(planes, mute):
    a = planes()
    peer = mute.getsockname()
    watcher = Watcher()
    a.watch([peer], watcher)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            mute.sendto(PACKET.pack(MAGIC, PONG, b"x" * 8), a.address)
            time.sleep(HEARTBEAT_S / 10)

    thread = threading.Thread(target=forge)
    thread.start()
    try:
        assert watcher.wait("silent") == [peer]
    finally:
        stop.set()
        thread.join()


def test_a_closing_plane_says_goodbye(planes):
    a, b = planes(), planes()
    watcher = Watcher()
    a.watch([b.address], watcher)
    time.sleep(HEARTBEAT_S)
    b.close()
    time.sleep(4 * HEARTBEAT_S)
    assert watcher.silent == []


def test_a_silent_peer_that_speaks_again_is_fenced(planes, mute):
    a = planes()
    peer = mute.getsockname()
    watcher = Watcher()
    a.watch([peer], watcher)
    assert watcher.wait("silent") == [peer]
    mute.settimeout(0.05)
    with pytest.raises(OSError):  # drain the pings sent while it was watched
        while True:
            mute.recvfrom(64)
    mute.settimeout(5.0)
    mute.sendto(PACKET.pack(MAGIC, PING, _token(_key())), a.address)
    magic, kind, _ = PACKET.unpack(mute.recvfrom(64)[0])
    assert (magic, kind) == (MAGIC, FENCED)


def test_a_fenced_plane_tells_its_watchers_and_agrees_no_more(planes, mute):
    a, b = planes(), planes()
    watcher = Watcher()
    a.watch([b.address], watcher)
    channel = AgreeChannel(a, "fenced", 0, [a.address, b.address])
    mute.sendto(PACKET.pack(MAGIC, FENCED, _token(_key())), a.address)
    assert watcher.wait("fenced") == [mute.getsockname()]
    assert a.fenced == mute.getsockname()
    with pytest.raises(ExcludedError, match="excluded this one"):
        channel.agree(True, timeout=5.0)
    channel.close()


def test_turned_off_it_calls_nobody_silent_and_still_answers(mute):
    plane = ControlPlane("127.0.0.1", _key(), timeout=5.0, heartbeat_s=0.0)
    try:
        watcher = Watcher()
        plane.watch([mute.getsockname()], watcher)
        time.sleep(1.5)  # longer than the pace of a heartbeat that only answers (1 s)
        assert watcher.silent == []
        # A peer that watches it with a heartbeat of its own is answered.
        mute.sendto(PACKET.pack(MAGIC, PING, _token(_key())), plane.address)
        magic, kind, _ = PACKET.unpack(mute.recvfrom(64)[0])
        assert (magic, kind) == (MAGIC, PONG)
    finally:
        plane.close()
