"""Fuzzing the rendezvous store while a real job runs: a stranger on loopback sends thousands of
malformed frames (each on its own connection), holds 300 idle connections and 10 slow ones that
dribble a hello, while two ranks run allreduces and join the store again and again (a fresh
communicator every few rounds). The job stays bit-exact, rank 0 (which serves the store) stays
within +20 MB, and its fds and threads come back to their baseline once the stranger leaves.
"""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time

import numpy as np

from ddlcore.job import store_wire as wire
from ddlcore.security.auth import MAX_CLAIM_BYTES, new_secret
from tests.harness import free_port, run_ranks

_HELLO = struct.Struct("<IHH")
_AUTH_MAGIC = 0xDD1A7E57
_SIZES = (1, 7, 1009, 4099)
_REINIT_EVERY = 25
MALFORMED = 2000
IDLE = 300
SLOW = 10


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _usage() -> dict[str, int]:
    return {
        "rss_kb": _status("VmRSS"),
        "threads": threading.active_count(),
        "os_threads": _status("Threads"),
        "fds": len(os.listdir("/proc/self/fd")),
    }


def _expected(i: int, size: int) -> bytes:
    n = _SIZES[i % len(_SIZES)]
    total = np.zeros(n)
    for r in range(size):
        total = total + np.random.default_rng([r, i]).standard_normal(n)
    return total.tobytes()


def _fuzz_job(rank, size, workdir):
    import gc

    import ddlcore

    comm = ddlcore.init(timeout=60)
    wrong = rounds = 0

    def one_round(i: int) -> None:
        nonlocal wrong, rounds
        x = np.random.default_rng([rank, i]).standard_normal(_SIZES[i % len(_SIZES)])
        wrong += comm.allreduce(x).tobytes() != _expected(i, size)
        rounds += 1

    i = 0
    for _ in range(2):  # warm up, with one fresh communicator, before the baseline
        for _ in range(_REINIT_EVERY):
            one_round(i)
            i += 1
        comm.close()
        comm = ddlcore.init(timeout=60)
    gc.collect()
    baseline = _usage()
    if rank == 0:
        with open(os.path.join(workdir, "ready"), "w") as f:
            f.write("1")
    done = os.path.join(workdir, "done")
    deadline = time.monotonic() + 120
    reinits = 0
    while True:
        one_round(i)
        i += 1
        if i % _REINIT_EVERY == 0:  # meet at the store again, under fire
            comm.close()
            comm = ddlcore.init(timeout=60)
            reinits += 1
        stop = os.path.exists(done) or time.monotonic() > deadline
        if comm.allreduce(np.array([stop], np.int64), op="max")[0]:
            break
    gc.collect()
    after = _usage()
    if rank == 0:  # the store lets go of the stranger's connections as it notices them close
        settle = time.monotonic() + 15
        while (
            after["fds"] > baseline["fds"] or after["threads"] > baseline["threads"]
        ) and time.monotonic() < settle:
            time.sleep(0.1)
            after = _usage()
    comm.close()
    return {
        "wrong": wrong,
        "rounds": rounds,
        "reinits": reinits,
        "baseline": baseline,
        "after": after,
    }


def _malformed_frames(rng: random.Random) -> list[tuple[bytes, bool]]:
    """(frame, whether the store refuses it as soon as it has it all)."""
    hello_head = _HELLO.pack(_AUTH_MAGIC, 1, 0)
    frames = [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        _HELLO.pack(_AUTH_MAGIC, 1, MAX_CLAIM_BYTES + 1),
        _HELLO.pack(_AUTH_MAGIC, 0xFFFF, 4) + os.urandom(36),
        _HELLO.pack(_AUTH_MAGIC, 1, 0xFFFF),
        wire.REQUEST.pack(wire.MAGIC, wire.SET, 0, 1, wire.MAX_VALUE_BYTES, 0, 0),
        wire.REQUEST.pack(wire.MAGIC, wire.GET, 0, 4, 0, 0, 2**63 - 1) + b"g0/x",
        wire.REQUEST.pack(wire.MAGIC, wire.DELETE, 0, 9, 0, 0, 0) + b"g0/peer/1",
    ]  # each refused from its first 8 bytes
    out = []
    for k in range(MALFORMED):
        kind = k % 5
        if kind == 0:  # random bytes
            out.append((os.urandom(rng.randrange(1, 200)), False))
        elif kind == 1:  # a fixed nasty frame
            out.append((frames[rng.randrange(len(frames))], True))
        elif kind == 2:  # a valid hello, then a made-up proof (and a request after it)
            claim = b"ddl-store rank=1 size=2"
            out.append(
                (
                    _HELLO.pack(_AUTH_MAGIC, 1, len(claim))
                    + os.urandom(32)
                    + claim
                    + os.urandom(32)
                    + wire.REQUEST.pack(wire.MAGIC, wire.SET, 0, 1, 1, 0, 0)
                    + b"kv",
                    True,
                )
            )
        elif kind == 3:  # a hello cut short
            whole = hello_head + os.urandom(32)
            out.append((whole[: rng.randrange(1, len(whole))], False))
        else:  # a valid header with a random claim length and random bytes after it
            n = rng.randrange(0, MAX_CLAIM_BYTES + 1)
            out.append(
                (_HELLO.pack(_AUTH_MAGIC, 1, n) + os.urandom(rng.randrange(0, 32 + n + 40)), False)
            )
    return out


def _stranger(port: int, workdir: str, report: dict) -> None:
    """Malformed frames, idle and slow connections against the store on ``port``, once the job
    says it is ready; then leave and say so."""
    ready = os.path.join(workdir, "ready")
    deadline = time.monotonic() + 90
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.05)
    rng = random.Random(19)
    stop = threading.Event()
    hello = _HELLO.pack(_AUTH_MAGIC, 1, 0) + os.urandom(32)
    slow_sent = [0]

    def slow() -> None:  # one byte of a hello every 0.2 s; again when the store drops it
        sock, pos = None, 0
        while not stop.is_set():
            try:
                if sock is None:
                    sock, pos = socket.create_connection(("127.0.0.1", port), timeout=5), 0
                sock.send(hello[pos : pos + 1])
                slow_sent[0] += 1
                pos = min(pos + 1, len(hello) - 1)
            except OSError:
                if sock is not None:
                    sock.close()
                sock = None
            stop.wait(0.2)
        if sock is not None:
            sock.close()

    slow_threads = [threading.Thread(target=slow) for _ in range(SLOW)]
    for t in slow_threads:
        t.start()
    idle = []
    for _ in range(IDLE):
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError as exc:
            report.setdefault("idle errors", []).append(str(exc))
    sent = 0
    hung_up = 0
    for frame, refused in _malformed_frames(rng):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
                sock.sendall(frame)
                if refused:  # wait for the store to hang up (others: leave first)
                    sock.settimeout(10)
                    try:
                        while sock.recv(128):  # a challenge and a refusal, at most
                            pass
                        hung_up += 1
                    except ConnectionResetError:
                        hung_up += 1
                    except OSError:
                        pass
            sent += 1
        except OSError as exc:
            report.setdefault("frame errors", []).append(str(exc))
    stop.set()
    for t in slow_threads:
        t.join(10)
    for sock in idle:
        sock.close()
    report.update(sent=sent, hung_up=hung_up, idle=len(idle), slow_bytes=slow_sent[0])
    with open(os.path.join(workdir, "done"), "w") as f:
        f.write("1")


def test_store_fuzz_while_a_job_runs(tmp_path):
    port, workdir, report = free_port(), str(tmp_path), {}
    stranger = threading.Thread(target=_stranger, args=(port, workdir, report))
    stranger.start()
    try:
        results = run_ranks(
            _fuzz_job,
            2,
            workdir,
            timeout=240,
            env={"DDL_SECRET": new_secret(), "DDL_MASTER_PORT": str(port)},
        )
    finally:
        stranger.join(120)
    assert report.get("sent", 0) >= MALFORMED and report["idle"] == IDLE, report
    assert report["slow_bytes"] > SLOW and report["hung_up"] >= 2 * MALFORMED // 5, report
    for rank, res in enumerate(results):
        assert res["wrong"] == 0 and res["rounds"] > 2 * _REINIT_EVERY, (rank, res)
    rank0 = results[0]
    assert rank0["reinits"] >= 1, rank0  # the store was used while under attack
    base, after = rank0["baseline"], rank0["after"]
    assert after["rss_kb"] - base["rss_kb"] < 20 * 1024, rank0
    assert after["fds"] <= base["fds"] and after["threads"] <= base["threads"], rank0
    assert after["os_threads"] <= base["os_threads"], rank0
