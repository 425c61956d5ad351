"""`ddlcore.resilience.control.ControlPlane`, several planes in one process: frames reach the
channel they name (held until it opens), a closed or dead plane is reported lost to every open
channel once, after the frames it sent, a plane with another key is lost (never heard), and a
frame for a lost peer is dropped."""

from __future__ import annotations

import threading
import time

import pytest

from ddlcore.resilience.control import ControlPlane
from ddlcore.security.auth import JobKey

CH = b"channel1"
OTHER = b"channel2"


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.cond = threading.Condition()

    def on_frame(self, peer, instance, kind, body):
        with self.cond:
            self.events.append(("frame", peer, instance, kind, body))
            self.cond.notify_all()

    def on_lost(self, peer):
        with self.cond:
            self.events.append(("lost", peer))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = 10.0) -> list[tuple]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.events) < n:
                left = deadline - time.monotonic()
                assert left > 0, self.events
                self.cond.wait(left)
            return list(self.events)


def _key(secret: bytes = b"s" * 32) -> JobKey:
    key = JobKey(secret, "1234", "a test")
    key.job_id = b"j" * 16
    return key


@pytest.fixture
def planes():
    made: list[ControlPlane] = []

    def make(key: JobKey | None = None) -> ControlPlane:
        plane = ControlPlane("127.0.0.1", key or _key(), timeout=5.0)
        made.append(plane)
        return plane

    yield make
    for plane in made:
        plane.close()


def test_frames_reach_their_channel_in_order_and_close_is_lost_after_them(planes):
    a, b = planes(), planes()
    got = Recorder()
    b.open_channel(CH, got, [a.address])
    for i in range(50):
        a.send(b.address, CH, i, 2, bytes([i]) * i)
    a.close()
    events = got.wait_for(51)
    assert events[:50] == [("frame", a.address, i, 2, bytes([i]) * i) for i in range(50)]
    assert events[50] == ("lost", a.address)
    time.sleep(0.2)
    assert len(got.events) == 51  # lost once


def test_frames_for_a_channel_not_open_yet_are_held(planes):
    a, b = planes(), planes()
    a.send(b.address, OTHER, 7, 1, b"early")
    time.sleep(0.3)
    got = Recorder()
    b.open_channel(OTHER, got, [a.address])
    assert got.wait_for(1) == [("frame", a.address, 7, 1, b"early")]


def test_a_refused_dial_is_lost_and_later_frames_are_dropped(planes):
    a, b = planes(), planes()
    gone = b.address
    b.close()
    got = Recorder()
    a.open_channel(CH, got, [gone])
    a.send(gone, CH, 0, 1, b"x")
    assert got.wait_for(1) == [("lost", gone)]
    assert a.lost(gone)
    a.send(gone, CH, 1, 1, b"y")  # dropped, no second report
    time.sleep(0.2)
    assert got.events == [("lost", gone)]
    late = Recorder()
    a.open_channel(OTHER, late, [gone])  # a channel opened later hears of it at once
    assert late.events == [("lost", gone)]


def test_a_plane_with_another_secret_is_never_heard(planes):
    a, stranger = planes(), planes(_key(b"t" * 32))
    got, theirs = Recorder(), Recorder()
    a.open_channel(CH, got, [stranger.address])
    stranger.open_channel(CH, theirs, [a.address])
    stranger.send(a.address, CH, 0, 1, b"forged")
    a.send(stranger.address, CH, 0, 1, b"hello")
    assert got.wait_for(1) == [("lost", stranger.address)]
    assert theirs.wait_for(1) == [("lost", a.address)]


def test_a_frame_too_large_is_refused(planes):
    a = planes()
    with pytest.raises(ValueError, match="control frame"):
        a.send(("127.0.0.1", 9), CH, 0, 1, bytes(70000))


@pytest.mark.parametrize(
    ("claim", "words"),
    [
        ({"service": "tcp"}, "serves control, not tcp"),
        ({"service": "control", "job_id": b"k" * 16}, "another start of this job"),
        ({"service": "control", "extra": b"short"}, "address is 5 bytes"),
    ],
    ids=["another-service", "another-start", "no-address"],
)
def test_a_plane_refuses_claims_not_for_it_before_proving_anything(planes, claim, words):
    import socket

    from ddlcore.security.auth import HandshakeRefused
    from ddlcore.security.claims import Claim

    a = planes()
    key = _key()
    fields = {"extra": bytes(18), "job_id": key.job_id, **claim}
    with socket.create_connection(a.address, timeout=5) as sock:
        with pytest.raises(HandshakeRefused, match=words) as info:
            key.connect(sock, Claim(**fields), time.monotonic() + 5)
    assert not info.value.proven


_PARENT = """
import os, signal, sys, time
from ddlcore.resilience.control import ControlPlane
from ddlcore.security.auth import JobKey
key = JobKey(b"s" * 32, "1234", "a test")
key.job_id = b"j" * 16
a = ControlPlane("127.0.0.1", key, timeout=5.0)
a.send(("127.0.0.1", int(sys.argv[1])), b"channel1", 0, 1, b"hi")
a.flush(5.0)
pid = os.fork()
if pid == 0:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    time.sleep(60)
    os._exit(0)
print(pid, a.address[1], flush=True)
time.sleep(0.3)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_forked_child_holds_no_connection_open_past_its_parent(planes, tmp_path):
    """A child forked while the plane is connected (a data loader's worker) drops its copies:
    when the parent is killed, the peer hears it lost although the child lives on."""
    import os
    import signal
    import subprocess
    import sys

    b = planes()
    got = Recorder()
    script = tmp_path / "parent.py"
    script.write_text(_PARENT)
    proc = subprocess.run(
        [sys.executable, str(script), str(b.address[1])], capture_output=True, text=True, timeout=60
    )
    child, port = (int(w) for w in proc.stdout.split())
    try:
        b.open_channel(CH, got, [("127.0.0.1", port)])
        events = got.wait_for(2)
        assert events[0][:3] == ("frame", ("127.0.0.1", port), 0)
        assert events[1] == ("lost", ("127.0.0.1", port))
    finally:
        os.kill(child, signal.SIGKILL)
