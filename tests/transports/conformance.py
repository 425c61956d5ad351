"""Conformance checks every transport must pass, written once and run inside spawned ranks.

Each public function here is ``fn(rank, size, transport_name, ...)`` for `tests.harness.run_ranks`:
rank 0 serves the rendezvous store at ``DDL_MASTER_ADDR:DDL_MASTER_PORT`` (set by the harness),
every rank creates the named transport's context through a `StoreClient`, runs its part of the
check (asserting inside the rank: the harness forwards tracebacks) and returns what the parent
test wants to look at (timings, error messages). The semantics checked are those written in
``ddlcore.transports.base``. ``test_conformance.py`` parametrises these over transport names.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
from ddlcore.transports.base import (
    ABORT_MISMATCH,
    ABORT_OTHER,
    ABORT_PEER_FAILURE,
    ABORT_TIMEOUT,
    MAX_ABORT_REASON_BYTES,
    Context,
    Transport,
)

from ddlcore import config
from ddlcore.errors import (
    CollectiveMismatchError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
)
from ddlcore.job.store import PrefixStore, StoreClient, StoreServer

# Transport name -> "module:class". A new transport is one line here plus its name in
# test_conformance.TRANSPORTS; classes are imported lazily so a missing optional one only skips.
TRANSPORT_CLASSES = {
    "tcp": "ddlcore.transports.tcp:TcpTransport",
    "mpi": "ddlcore.transports.mpi:MpiTransport",
    "shm": "ddlcore.transports.shm:ShmTransport",
    "ucx": "ddlcore.transports.ucx:UcxTransport",
}

TIMEOUT_S = 5.0  # every wait in these checks; a failing check fails in seconds, never hangs
# The 256 MB transfer's deadline: a no-hang guard only (inside the tests' 60 s job deadline), not
# a speed check; a loaded machine may take many seconds to move it.
LARGE_TIMEOUT_S = 50.0


def transport_class(name: str) -> type[Transport]:
    module, _, attr = TRANSPORT_CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


class RankEnv:
    """One rank's store connection (and rank 0's store server) plus helpers to make contexts."""

    def __init__(self, rank: int, size: int, transport: str, timeout: float = TIMEOUT_S) -> None:
        self.rank, self.size, self.transport, self.timeout = rank, size, transport, timeout
        host, port = config.get("DDL_MASTER_ADDR"), config.get("DDL_MASTER_PORT")
        # As init does: MPI_Init holds the GIL until every rank has joined, so on the rank serving
        # the store it must come first, or the store's thread cannot answer the other ranks'
        # handshakes and they never reach MPI_Init (an intermittent deadlock).
        transport_class(transport).prepare()
        self.server = StoreServer(host, port) if rank == 0 else None
        self.client = StoreClient(host, port, timeout, rank=rank, size=size)
        self.contexts: list[Context] = []

    def context(self, namespace: str = "conf") -> Context:
        store = PrefixStore(self.client, f"{namespace}/")
        ctx = transport_class(self.transport)().create_context(
            self.rank, self.size, store, self.timeout
        )
        self.contexts.append(ctx)
        return ctx

    def barrier(self, name: str) -> None:
        self.client.barrier(name, timeout=self.timeout)

    def close(self) -> None:
        """Close every context, then keep rank 0's store up until the others have left it."""
        for ctx in self.contexts:
            ctx.close()
        self.client.close()
        if self.server is not None:
            self.server.close(linger=self.timeout)


@contextmanager
def rank_env(rank: int, size: int, transport: str, timeout: float = TIMEOUT_S) -> Iterator[RankEnv]:
    env = RankEnv(rank, size, transport, timeout)
    try:
        yield env
    finally:
        env.close()


def payload(src: int, tag: int, seq: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes for message ``seq`` of ``src`` with ``tag``; the first 16 bytes (when
    there is room) say which message it is, so a misordered delivery names itself."""
    seed = (src * 1_000_003 + tag * 7919 + seq * 104_729) & 0xFFFFFFFF
    data = ((np.arange(nbytes, dtype=np.uint32) * 2_654_435_761 + seed) >> 13).astype(np.uint8)
    if nbytes >= 16:
        data[:16] = np.frombuffer(struct.pack("<QQ", tag & (2**64 - 1), seq), np.uint8)
    return data


def expect(buf: np.ndarray, src: int, tag: int, seq: int) -> None:
    want = payload(src, tag, seq, buf.nbytes)
    if not np.array_equal(buf, want):
        got = struct.unpack("<QQ", buf[:16].tobytes()) if buf.nbytes >= 16 else "?"
        raise AssertionError(
            f"message {seq} of tag {tag} from rank {src} ({buf.nbytes} bytes) "
            f"has the wrong content; its header says (tag, seq) = {got}"
        )


def wait_all(reqs, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    for req in reqs:
        req.wait(max(0.0, deadline - time.monotonic()))


def _size_of(i: int) -> int:
    return (0, 1, 7, 64, 1000, 4096, 65_537)[i % 7]


# --- ordering and matching ------------------------------------------------------------------------
def ordering_same_tag(rank: int, size: int, transport: str, count: int = 600) -> None:
    """Many messages with one tag arrive in order, whether the receive was posted before the
    message arrived or after."""
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        tag = 3
        if rank == 0:
            env.barrier("posted")
            wait_all(
                [pair.isend(memoryview(payload(0, tag, i, _size_of(i))), tag) for i in range(count)]
            )
            env.barrier("sent")
        else:
            half = count // 2
            bufs = [np.empty(_size_of(i), np.uint8) for i in range(count)]
            early = [pair.irecv(memoryview(bufs[i]), tag) for i in range(half)]
            env.barrier("posted")
            env.barrier("sent")
            time.sleep(0.05)  # the second half has (mostly) arrived unexpected by now
            late = [pair.irecv(memoryview(bufs[i]), tag) for i in range(half, count)]
            wait_all(early + late)
            for i, buf in enumerate(bufs):
                expect(buf, 0, tag, i)


def interleaved_tags(rank: int, size: int, transport: str, per_tag: int = 100) -> None:
    """Messages with different tags overtake each other only across tags: the receiver drains the
    tags in the reverse order of sending, half posted before arrival, and each tag's messages
    still come in order. Tags span the whole u64 range."""
    tags = [0, 1, 2, 2**32 + 5, 2**63 + 1, 2**64 - 1]
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        if rank == 0:
            env.barrier("posted")
            reqs = []
            for i in range(per_tag):
                for tag in tags:
                    reqs.append(pair.isend(memoryview(payload(0, tag, i, _size_of(i + tag))), tag))
            wait_all(reqs)
        else:
            bufs = {
                (t, i): np.empty(_size_of(i + t), np.uint8) for t in tags for i in range(per_tag)
            }
            reqs = [pair.irecv(memoryview(bufs[tags[-1], i]), tags[-1]) for i in range(per_tag)]
            env.barrier("posted")
            for tag in reversed(tags[:-1]):
                reqs += [pair.irecv(memoryview(bufs[tag, i]), tag) for i in range(per_tag)]
            wait_all(reqs)
            for (tag, i), buf in bufs.items():
                expect(buf, 0, tag, i)


def many_outstanding(rank: int, size: int, transport: str, count: int = 1000) -> None:
    """``count`` sends and ``count`` receives in flight at once, in both directions."""
    with rank_env(rank, size, transport) as env:
        peer = 1 - rank
        pair = env.context().pair(peer)
        bufs = [np.empty(256, np.uint8) for _ in range(count)]
        recvs = [pair.irecv(memoryview(bufs[i]), i % 10) for i in range(count)]
        sends = [
            pair.isend(memoryview(payload(rank, i % 10, i // 10, 256)), i % 10)
            for i in range(count)
        ]
        wait_all(sends + recvs)
        for i, buf in enumerate(bufs):
            expect(buf, peer, i % 10, i // 10)
        assert all(r.test() for r in sends + recvs)


def zero_bytes(rank: int, size: int, transport: str) -> None:
    """Empty messages are messages: they match, keep their place in the order, and carry checks."""
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        sizes = [0, 5, 0, 0, 3, 0]
        if rank == 0:
            wait_all(
                [
                    pair.isend(memoryview(payload(0, 9, i, n)), 9, check=0xC0FFEE)
                    for i, n in enumerate(sizes)
                ]
            )
            pair.isend(memoryview(b""), 10).wait(TIMEOUT_S)
            env.barrier("sent")
        else:
            first = np.empty(0, np.uint8)
            r0 = pair.irecv(memoryview(first), 9, check=0xC0FFEE)  # posted before arrival
            env.barrier("sent")
            bufs = [np.empty(n, np.uint8) for n in sizes[1:]]
            reqs = [r0] + [pair.irecv(memoryview(b), 9, check=0xC0FFEE) for b in bufs]
            reqs.append(pair.irecv(memoryview(bytearray()), 10))  # arrived before posting
            wait_all(reqs)
            for i, buf in enumerate(bufs, start=1):
                expect(buf, 0, 9, i)


# --- volume ---------------------------------------------------------------------------------------
def large_message(rank: int, size: int, transport: str, nbytes: int) -> tuple[float, int]:
    """One ``nbytes`` message, received straight into a posted buffer; content checked with a
    CRC on both sides. Returns (seconds, crc) as the receiver saw them."""
    with rank_env(rank, size, transport, timeout=LARGE_TIMEOUT_S) as env:
        pair = env.context().pair(1 - rank)
        if rank == 0:  # connect first, so the timing is of the transfer alone
            pair.isend(memoryview(b"warm"), 1).wait(TIMEOUT_S)
        else:
            pair.irecv(memoryview(bytearray(4)), 1).wait(TIMEOUT_S)
        if rank == 0:
            data = np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            crc = zlib.crc32(data)
            env.barrier("posted")
            req = pair.isend(memoryview(data).cast("B"), 2)
            req.wait(LARGE_TIMEOUT_S)
            pair.isend(memoryview(struct.pack("<Q", crc)), 3).wait(TIMEOUT_S)
            return 0.0, crc
        out = np.empty(nbytes // 8 * 8, np.uint8)
        out.fill(0)  # touch the pages: time the transport, not first-touch page faults
        req = pair.irecv(memoryview(out), 2)
        env.barrier("posted")
        t0 = time.perf_counter()
        req.wait(LARGE_TIMEOUT_S)
        elapsed = time.perf_counter() - t0
        sent_crc = bytearray(8)
        pair.irecv(memoryview(sent_crc), 3).wait(TIMEOUT_S)
        crc = zlib.crc32(out)
        assert crc == struct.unpack("<Q", sent_crc)[0], "256 MB message arrived corrupted"
        return elapsed, crc


def large_message_paths(rank: int, size: int, transport: str) -> list[str]:
    """Large messages (where transports switch protocol: UCX's separate payload, shm's
    single-copy read): a size mismatch posted before and after arrival (the payload is drained,
    later messages are intact), one taken into a buffer of the transport's own, and one whose
    receive is posted while the payload may still be arriving."""
    n = 1 << 20
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        if rank == 0:
            big = payload(0, 4, 0, 32 * n)
            env.barrier("posted")
            for tag in (1, 2, 3):
                pair.isend(memoryview(payload(0, tag, 0, n)), tag).wait(TIMEOUT_S)
            env.barrier("sent")
            env.barrier("go")
            pair.isend(memoryview(big), 4).wait(TIMEOUT_S)
            env.barrier("done")
            return []
        early = pair.irecv(memoryview(np.empty(n - 1, np.uint8)), 1)
        env.barrier("posted")
        env.barrier("sent")
        time.sleep(0.05)
        late = pair.irecv(memoryview(np.empty(n + 1, np.uint8)), 2)
        messages = []
        for req in (early, late):
            try:
                req.wait(TIMEOUT_S)
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
            else:
                raise AssertionError("a receive of the wrong size succeeded")
        unexpected = np.empty(n, np.uint8)
        pair.irecv(memoryview(unexpected), 3).wait(TIMEOUT_S)
        expect(unexpected, 0, 3, 0)
        big = np.empty(32 * n, np.uint8)
        big.fill(0)  # touch the pages now, not while the payload arrives
        env.barrier("go")
        time.sleep(0.005)  # the 32 MB header is (likely) in, its payload (likely) not yet
        pair.irecv(memoryview(big), 4).wait(TIMEOUT_S)
        expect(big, 0, 4, 0)
        env.barrier("done")
        return messages


def both_directions(rank: int, size: int, transport: str, nbytes: int = 32 << 20) -> None:
    """Large and small messages in both directions at the same time, from two threads each."""
    with rank_env(rank, size, transport) as env:
        peer = 1 - rank
        pair = env.context().pair(peer)
        big_out = payload(rank, 100, 0, nbytes)
        big_in = np.empty(nbytes, np.uint8)
        small_in = [np.empty(_size_of(i), np.uint8) for i in range(300)]
        errors: list[BaseException] = []

        def chatter() -> None:
            try:
                reqs = [
                    pair.isend(memoryview(payload(rank, 7, i, _size_of(i))), 7) for i in range(300)
                ]
                wait_all(reqs)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the rank below
                errors.append(exc)

        recvs = [pair.irecv(memoryview(big_in), 100)]
        recvs += [pair.irecv(memoryview(b), 7) for b in small_in]
        env.barrier("posted")
        thread = threading.Thread(target=chatter)
        thread.start()
        pair.isend(memoryview(big_out), 100).wait(TIMEOUT_S)
        thread.join(TIMEOUT_S)
        wait_all(recvs)
        if errors:
            raise errors[0]
        expect(big_in, peer, 100, 0)
        for i, buf in enumerate(small_in):
            expect(buf, peer, 7, i)


def all_pairs(rank: int, size: int, transport: str, rounds: int = 3) -> None:
    """Every rank exchanges with every other rank at once, a few rounds, tags per (src, dst)."""
    with rank_env(rank, size, transport) as env:
        ctx = env.context()
        peers = [p for p in range(size) if p != rank]
        for r in range(rounds):
            inbox = {p: np.empty(1000 + 10 * p, np.uint8) for p in peers}
            recvs = [ctx.pair(p).irecv(memoryview(inbox[p]), p * size + rank) for p in peers]
            sends = [
                ctx.pair(p).isend(
                    memoryview(payload(rank, rank * size + p, r, 1000 + 10 * rank)), rank * size + p
                )
                for p in peers
            ]
            wait_all(recvs + sends)
            for p in peers:
                expect(inbox[p], p, p * size + rank, r)


def sends_do_not_wait_for_the_receiver(rank: int, size: int, transport: str) -> None:
    """Posting a send or receive never waits for the peer's program to reach its side: rank 2
    sends to 1 before 0, rank 1 talks to 0 before 2, rank 0 waits for 2 first. A transport
    whose ``pair()`` or ``isend`` blocked until the peer connects would deadlock here. At the
    end ranks 0 and 1 tell rank 2 they have its message: a send completes once its bytes are
    the transport's, not the peer's, so rank 2 closing at once could take them away (shm: its
    segment) from a peer that has not connected yet."""
    with rank_env(rank, size, transport) as env:
        ctx = env.context()
        msg = {2: np.arange(100, dtype=np.uint8), 1: np.arange(50, dtype=np.uint8)}
        done = np.ones(1, np.uint8)
        if rank == 2:
            wait_all(
                [
                    ctx.pair(1).isend(memoryview(msg[2]), 21),
                    ctx.pair(0).isend(memoryview(msg[2]), 20),
                ]
            )
            wait_all([ctx.pair(p).irecv(memoryview(np.empty(1, np.uint8)), 99) for p in (0, 1)])
        elif rank == 1:
            send = ctx.pair(0).isend(memoryview(msg[1]), 10)
            got = np.empty(100, np.uint8)
            ctx.pair(2).irecv(memoryview(got), 21).wait(TIMEOUT_S)
            send.wait(TIMEOUT_S)
            assert np.array_equal(got, msg[2])
            ctx.pair(2).isend(memoryview(done), 99).wait(TIMEOUT_S)
        else:
            got2, got1 = np.empty(100, np.uint8), np.empty(50, np.uint8)
            ctx.pair(2).irecv(memoryview(got2), 20).wait(TIMEOUT_S)
            ctx.pair(1).irecv(memoryview(got1), 10).wait(TIMEOUT_S)
            assert np.array_equal(got2, msg[2]) and np.array_equal(got1, msg[1])
            ctx.pair(2).isend(memoryview(done), 99).wait(TIMEOUT_S)


def concurrent_waiters(
    rank: int, size: int, transport: str, nthreads: int = 4, rounds: int = 20
) -> None:
    """Several threads of rank 1 wait at once on receives from rank 0 (one tag each, so on one
    channel or several), while rank 0 sends the tags in an order that differs every round: every
    receive completes with its own bytes. A transport whose waiters read the socket themselves
    must hand the reading on, not leave the others waiting for a thread that stood back."""
    with rank_env(rank, size, transport) as env:
        ctx = env.context()
        pair = ctx.pair(1 - rank)
        rng = np.random.default_rng(7)
        for r in range(rounds):
            order = rng.permutation(nthreads)
            if rank == 0:
                env.barrier(f"posted{r}")
                wait_all(
                    [
                        pair.isend(
                            memoryview(payload(0, int(t), r, _size_of(int(t) + r))), 100 + int(t)
                        )
                        for t in order
                    ]
                )
                continue
            errors: list[BaseException] = []

            def receive(t: int, r: int = r, errors: list[BaseException] = errors) -> None:
                try:
                    got = np.empty(_size_of(t + r), np.uint8)
                    pair.irecv(memoryview(got), 100 + t).wait(TIMEOUT_S)
                    expect(got, 0, t, r)
                except BaseException as exc:  # reported by the main thread
                    errors.append(exc)

            threads = [threading.Thread(target=receive, args=(t,)) for t in range(nthreads)]
            for th in threads:
                th.start()
            env.barrier(f"posted{r}")
            for th in threads:
                th.join(2 * TIMEOUT_S)
            assert not any(th.is_alive() for th in threads), f"round {r}: a waiter hung"
            if errors:
                raise errors[0]
        env.barrier("done")


def failure_wakes_a_waiter(rank: int, size: int, transport: str) -> list[float]:
    """A thread waiting on a receive nobody sends to is failed by another thread of its rank
    (an abort, then close()): the wait ends at once with the failure, not at its deadline.
    Returns the seconds each wait took after the failure."""
    took = []
    with rank_env(rank, size, transport) as env:
        for how in ("abort", "close"):
            ctx = env.context(how)
            pair = _connected_pair(ctx, rank)
            env.barrier(f"connected-{how}")
            if rank == 1:
                pending = pair.irecv(memoryview(bytearray(8)), 2)
                # 0.3 s: the main thread is inside wait() by then
                took.append(_failed_by_another_thread(ctx, pending, how, 0.3)[1])
            env.barrier(f"checked-{how}")
    return took


def _connected_pair(ctx: Context, rank: int) -> Any:
    """The pair to rank ``1 - rank``, connected both ways (one message each way)."""
    pair = ctx.pair(1 - rank)
    pair.isend(memoryview(bytearray(8)), 1).wait(TIMEOUT_S)
    pair.irecv(memoryview(bytearray(8)), 1).wait(TIMEOUT_S)
    return pair


def _failed_by_another_thread(
    ctx: Context, req: Any, how: str, delay_s: float
) -> tuple[str, float]:
    """Wait on ``req`` while another thread of this rank, ``delay_s`` later, aborts ``ctx``
    (``how`` "abort") or closes it: the wait must end with that failure, not its timeout.
    Returns the error's message and the seconds from the failure to the end of the wait."""
    failed_at: list[float] = []

    def fail_it() -> None:
        time.sleep(delay_s)
        failed_at.append(time.monotonic())
        if how == "abort":
            ctx.abort(ABORT_OTHER, "stopped by another thread")
        else:
            ctx.close()

    th = threading.Thread(target=fail_it)
    th.start()
    try:
        req.wait(3 * TIMEOUT_S)
    except DDLError as exc:
        assert not isinstance(exc, DDLTimeoutError), exc
        message = str(exc)
    else:
        raise AssertionError(f"the receive survived {how}")
    took = time.monotonic() - failed_at[0]
    th.join(TIMEOUT_S)
    return message, took


# --- errors ---------------------------------------------------------------------------------------
def mismatches(rank: int, size: int, transport: str) -> list[str]:
    """Size and check-word disagreements fail that receive with CollectiveMismatchError (posted
    before or after arrival); a zero check matches anything; later messages are unaffected."""
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        if rank == 0:
            env.barrier("posted")
            for tag, n, check in [
                (5, 100, 0),
                (6, 100, 0xAAAA),
                (7, 64, 0),
                (8, 100, 0xBBBB),
                (9, 32, 0x1234),
                (11, 10, 0x77),
            ]:
                pair.isend(memoryview(payload(0, tag, 0, n)), tag, check=check).wait(TIMEOUT_S)
            env.barrier("sent")
            return []
        early_size = pair.irecv(memoryview(np.empty(200, np.uint8)), 5)
        early_check = pair.irecv(memoryview(np.empty(100, np.uint8)), 6, check=0xBBBB)
        env.barrier("posted")
        env.barrier("sent")
        late_size = pair.irecv(memoryview(np.empty(63, np.uint8)), 7)
        late_check = pair.irecv(memoryview(np.empty(100, np.uint8)), 8, check=0xAAAA)
        messages = []
        for req in (early_size, early_check, late_size, late_check):
            try:
                req.wait(TIMEOUT_S)
            except CollectiveMismatchError as exc:
                messages.append(str(exc))
            else:
                raise AssertionError("a mismatched receive succeeded")
        wildcard = np.empty(32, np.uint8)
        pair.irecv(memoryview(wildcard), 9, check=0).wait(TIMEOUT_S)  # 0 matches any check
        expect(wildcard, 0, 9, 0)
        after = np.empty(10, np.uint8)
        pair.irecv(memoryview(after), 11, check=0x77).wait(TIMEOUT_S)  # the stream is intact
        expect(after, 0, 11, 0)
        return messages


def timeouts(rank: int, size: int, transport: str, wait_s: float) -> list[tuple[str, float]]:
    """A receive nobody sends to times out after ``wait_s`` with DDLTimeoutError naming both
    ranks and the tag, both on a connected pair and towards a peer that never connected."""
    out: list[tuple[str, float]] = []
    with rank_env(rank, size, transport) as env:
        ctx = env.context()
        if rank == 1:
            pair = ctx.pair(0)
            req = pair.irecv(memoryview(bytearray(16)), 0xABC)
            for _ in range(2):  # a timed-out wait can be retried, and times out again
                t0 = time.monotonic()
                try:
                    req.wait(wait_s)
                except DDLTimeoutError as exc:
                    out.append((str(exc), time.monotonic() - t0))
                else:
                    raise AssertionError("wait returned although nothing was sent")
            assert not req.test()
        if rank == 2:  # rank 0 never touches its pair to rank 2
            req = ctx.pair(0).irecv(memoryview(bytearray(16)), 0xDEF)
            t0 = time.monotonic()
            try:
                req.wait(wait_s)
            except DDLTimeoutError as exc:
                out.append((str(exc), time.monotonic() - t0))
        if rank == 0:
            ctx.pair(1)
        env.barrier("done")
    return out


def killed_peer(rank: int, size: int, transport: str, victim: int) -> tuple[str, float, str]:
    """``victim`` dies (os._exit) in the middle of a large transfer; every survivor's pending and
    later requests to it fail with PeerFailureError naming it, long before the timeout, while
    the survivors can still talk to each other."""
    nbytes = 128 << 20
    with rank_env(rank, size, transport, timeout=10.0) as env:
        ctx = env.context()
        peers = [p for p in range(size) if p != rank]
        all_pairs_round(ctx, rank, size, peers)  # everyone connected
        env.barrier("connected")
        if rank == victim:
            ctx.pair(0 if victim else 1).isend(memoryview(np.ones(nbytes, np.uint8)), 50)
            time.sleep(0.02)
            os._exit(17)
        first = 0 if victim else 1
        big = np.empty(nbytes, np.uint8)
        reqs = [
            ctx.pair(victim).irecv(memoryview(big if rank == first else bytearray(8)), 50),
            ctx.pair(victim).irecv(memoryview(bytearray(8)), 51),
        ]  # never sent
        t0 = time.monotonic()
        failure = None
        for req in reqs:
            try:
                req.wait(10.0)
            except PeerFailureError as exc:
                failure = failure or exc
        elapsed = time.monotonic() - t0
        assert failure is not None, f"rank {rank}: no PeerFailureError after rank {victim} died"
        later = ctx.pair(victim).isend(memoryview(b"x"), 52)
        try:
            later.wait(10.0)
        except PeerFailureError as exc:
            later_message = str(exc)
        else:
            later_message = ""
        all_pairs_round(ctx, rank, size, [p for p in peers if p != victim], seq=1)
        return str(failure), elapsed, later_message


def all_pairs_round(ctx: Context, rank: int, size: int, peers: list[int], seq: int = 0) -> None:
    inbox = {p: np.empty(64, np.uint8) for p in peers}
    recvs = [ctx.pair(p).irecv(memoryview(inbox[p]), 1000 + seq) for p in peers]
    sends = [
        ctx.pair(p).isend(memoryview(payload(rank, 1000 + seq, 0, 64)), 1000 + seq) for p in peers
    ]
    wait_all(recvs + sends)
    for p in peers:
        expect(inbox[p], p, 1000 + seq, 0)


ABORT_CODES = {
    ABORT_MISMATCH: CollectiveMismatchError,
    ABORT_TIMEOUT: DDLTimeoutError,
    ABORT_PEER_FAILURE: PeerFailureError,
    ABORT_OTHER: PeerFailureError,
}


def abort_propagation(rank: int, size: int, transport: str) -> list[tuple[str, str, float]]:
    """Rank 0 aborts (once per error code, each on its own context); rank 1's pending receive
    and later requests fail with the class of the code and rank 0's reason, and rank 0's own
    pending requests fail too. A reason over the cap is cut, not refused."""
    out = []
    with rank_env(rank, size, transport) as env:
        for code, cls in ABORT_CODES.items():
            ctx = env.context(f"abort{code}")
            pair = ctx.pair(1 - rank)
            reason = f"collective #{code} went wrong: ünïcödé" + (
                "x" * MAX_ABORT_REASON_BYTES if code == ABORT_OTHER else ""
            )
            if rank == 0:
                mine = pair.irecv(memoryview(bytearray(8)), 77)
                env.barrier(f"posted{code}")
                ctx.abort(code, reason)
                try:
                    mine.wait(TIMEOUT_S)
                except cls:
                    pass
                else:
                    raise AssertionError("a request survived our own abort")
                env.barrier(f"checked{code}")
                continue
            pending = pair.irecv(memoryview(bytearray(8)), 77)
            env.barrier(f"posted{code}")
            t0 = time.monotonic()
            try:
                pending.wait(TIMEOUT_S)
            except DDLError as exc:
                assert type(exc) is cls, (code, type(exc), exc)
                out.append((type(exc).__name__, str(exc), time.monotonic() - t0))
            else:
                raise AssertionError("the receive survived the peer's abort")
            later = pair.irecv(memoryview(bytearray(8)), 78)
            try:
                later.wait(TIMEOUT_S)
            except cls as exc:
                assert "rank 0 aborted" in str(exc), str(exc)
            else:
                raise AssertionError("a receive posted after the abort succeeded")
            env.barrier(f"checked{code}")
    return out


def bad_arguments(rank: int, size: int, transport: str) -> None:
    """Read-only receive buffers, tags outside u64, checks outside u32 and peers outside the
    world are argument errors, before anything is sent."""
    import pytest

    with rank_env(rank, size, transport) as env:
        ctx = env.context()
        pair = ctx.pair(1 - rank)
        with pytest.raises(ValueError, match="writable"):
            pair.irecv(memoryview(b"read-only"), 1)
        for tag, check in ((-1, 0), (2**64, 0), (1, -1), (1, 2**32)):
            with pytest.raises(ValueError):
                pair.isend(memoryview(b"x"), tag, check)
        with pytest.raises(ValueError):
            ctx.pair(rank)
        with pytest.raises(ValueError):
            ctx.pair(size)
        env.barrier("done")


# --- device memory --------------------------------------------------------------------------------
def _device_view(buf: np.ndarray, uploads: list[int], binds: list[str] | None = None) -> Any:
    """A `DeviceView` over host memory: what a transport's device path gets, minus the GPU (UCX
    and MPI find the memory type from the pointer, so host memory behind a device view moves
    the same way; on a GPU the same calls carry device memory). Uploads record their sizes,
    binds the thread that asked for the GPU to be made current."""
    from ddlcore.transports.base import DeviceView

    def upload(view: DeviceView, data: memoryview) -> None:
        uploads.append(len(data))
        ctypes.memmove(view.ptr, bytes(data), len(data))

    def bind() -> None:
        if binds is not None:
            binds.append(threading.current_thread().name)

    return DeviceView(buf.ctypes.data if buf.nbytes else 0, buf.nbytes, 0, upload, bind)


DEVICE_SIZES = (0, 1, 7, 4096, 4097, 65_537, 1 << 20)


def device_views(rank: int, size: int, transport: str) -> tuple[bool, list[int], list[str]]:
    """Pairs that take device memory: device to device, device to host and host to device, for
    sizes on both sides of the eager limit, receives posted before and after the message
    arrived (a host payload that arrived first, or a small one carried in its header, is
    uploaded). Pairs that do not refuse a device view with a ValueError. Returns
    (device_memory, the sizes uploaded on this rank, the threads that bound the GPU)."""
    import pytest

    uploads: list[int] = []
    binds: list[str] = []
    with rank_env(rank, size, transport) as env:
        pair = env.context().pair(1 - rank)
        if not pair.device_memory:
            buf = np.zeros(8, np.uint8)
            with pytest.raises(ValueError, match="device memory"):
                pair.isend(_device_view(buf, uploads), 1)
            with pytest.raises(ValueError, match="device memory"):
                pair.irecv(_device_view(buf, uploads), 1)
            env.barrier("done")
            return False, uploads, binds
        sizes = DEVICE_SIZES
        if rank == 0:  # sends: from device views (tag 1), from host memory (tag 2)
            env.barrier("early posted")
            dev = [payload(0, 1, i, n) for i, n in enumerate(sizes)]
            host = [payload(0, 2, i, n) for i, n in enumerate(sizes)]
            reqs = [pair.isend(_device_view(b, uploads, binds), 1) for b in dev]
            reqs += [pair.isend(memoryview(b), 2) for b in host]
            env.barrier("sent")  # (over MPI a large send ends only once its receive is posted)
            wait_all(reqs)
            env.barrier("done")
            return True, uploads, binds
        # rank 1: tag 1 into device views (first half posted early) and host memory; tag 2
        # (host sends, eager when small) into device views, the first half posted early (a
        # small payload rides in its header: uploaded by the transport's thread), the rest
        # after arrival (uploaded from the transport's buffer, or received in place)
        half = len(sizes) // 2
        got1 = [np.full(n, 0xEE, np.uint8) for n in sizes]
        got2 = [np.full(n, 0xEE, np.uint8) for n in sizes]
        reqs = [pair.irecv(_device_view(b, uploads, binds), 1) for b in got1[:half]]
        reqs += [pair.irecv(_device_view(b, uploads, binds), 2) for b in got2[:half]]
        env.barrier("early posted")
        env.barrier("sent")
        time.sleep(0.05)  # let the payloads land in the transport's own buffers
        reqs += [pair.irecv(memoryview(b), 1) for b in got1[half:]]
        reqs += [pair.irecv(_device_view(b, uploads, binds), 2) for b in got2[half:]]
        wait_all(reqs)
        for i, (a, b) in enumerate(zip(got1, got2, strict=True)):
            expect(a, 0, 1, i)
            expect(b, 0, 2, i)
        env.barrier("done")
        return True, uploads, binds


# --- lifetime -------------------------------------------------------------------------------------
def _transport_fds() -> set[str]:
    """Sockets and eventfds (the waiters' wake-ups of tcp and ucx) this process has open."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:") or link == "anon_inode:[eventfd]":
            out.add(f"{fd}->{link}")
    return out


def _shm_segments() -> set[str]:
    """Shared-memory segments this process owns (their names carry its pid)."""
    prefix = f"ddl-{os.getpid()}-"
    return (
        {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
        if os.path.isdir("/dev/shm")
        else set()
    )


def resources_released(rank: int, size: int, transport: str) -> tuple[int, int, int]:
    """After close(): no thread, socket or shared-memory segment the context made is left,
    pending requests have failed, and close() is idempotent. Returns (threads seen while open,
    sockets seen, segments seen)."""
    with rank_env(rank, size, transport) as env:
        env.barrier("clients up")  # every store connection exists before the baseline
        threads_before = {t.ident for t in threading.enumerate()}
        sockets_before = _transport_fds()
        ctx = env.context()
        all_pairs_round(ctx, rank, size, [p for p in range(size) if p != rank])
        pending = ctx.pair((rank + 1) % size).irecv(memoryview(bytearray(4)), 999)
        threads_open = len(threading.enumerate()) - len(threads_before)
        sockets_open = len(_transport_fds() - sockets_before)
        segments_open = len(_shm_segments())
        env.barrier("exchanged")
        ctx.close()
        ctx.close()
        try:
            pending.wait(TIMEOUT_S)
        except DDLError:
            pass
        else:
            raise AssertionError("a pending receive succeeded after close()")
        env.contexts.remove(ctx)
        left_threads = [t.name for t in threading.enumerate() if t.ident not in threads_before]
        left_sockets = _transport_fds() - sockets_before
        assert not left_threads, f"rank {rank}: threads left after close(): {left_threads}"
        assert not left_sockets, f"rank {rank}: descriptors left after close(): {left_sockets}"
        left_segments = _shm_segments()
        assert not left_segments, f"rank {rank}: shm segments left after close(): {left_segments}"
        env.barrier("checked")
        return threads_open, sockets_open, segments_open


# --- TCP specifics --------------------------------------------------------------------------------
def tcp_nchannels_mismatch(rank: int, size: int) -> str:
    """Ranks started with different DDL_NCHANNELS would disagree on which socket carries a tag:
    the connection is refused and both ends say which values differ."""
    from ddlcore.errors import RendezvousError

    with rank_env(rank, size, "tcp") as env:
        pair_or_error: object
        try:
            pair_or_error = env.context().pair(1 - rank)
        except RendezvousError as exc:
            pair_or_error = exc
        if rank == 0:
            assert isinstance(pair_or_error, RendezvousError), pair_or_error
            env.barrier("refused")
            return str(pair_or_error)
        env.barrier("refused")
        try:
            pair_or_error.irecv(memoryview(bytearray(1)), 0).wait(TIMEOUT_S)  # type: ignore[union-attr]
        except RendezvousError as exc:
            return str(exc)
        raise AssertionError("rank 1 accepted a connection with a different DDL_NCHANNELS")


def tcp_waiter_reads_its_socket(rank: int, size: int, rounds: int = 50) -> list[str]:
    """Ping-pong of small messages: the thread waiting on a receive reads it off the socket
    itself (no hand-off from the receiver thread). Returns, for rank 0, the name of the thread
    that completed each receive."""
    from ddlcore.transports import tcp

    completed_by: list[str] = []
    original = tcp.TcpRequest._complete

    def recording(req: tcp.TcpRequest) -> None:
        if not req.is_send:
            completed_by.append(threading.current_thread().name)
        original(req)

    tcp.TcpRequest._complete = recording  # type: ignore[method-assign]
    try:
        with rank_env(rank, size, "tcp") as env:
            pair = env.context().pair(1 - rank)
            msg = np.arange(4096, dtype=np.uint8)
            got = np.empty_like(msg)
            for i in range(rounds):
                if rank == 0:
                    pair.isend(memoryview(msg), i).wait(TIMEOUT_S)
                    pair.irecv(memoryview(got), i).wait(TIMEOUT_S)
                else:
                    pair.irecv(memoryview(got), i).wait(TIMEOUT_S)
                    pair.isend(memoryview(got), i).wait(TIMEOUT_S)
                assert np.array_equal(got, msg)
            env.barrier("done")
    finally:
        tcp.TcpRequest._complete = original  # type: ignore[method-assign]
    return completed_by


def _tcp_write_raw(pair: Any, data: bytes) -> None:
    """Write ``data`` on the pair's socket as it is (a frame cut anywhere), keeping the sender
    thread off the socket meanwhile."""
    ch = pair._channels[0]
    with ch.scond:
        ch.busy = True
    try:
        ch.sock.sendall(data)
    finally:
        with ch.scond:
            ch.busy = False
            ch.scond.notify()


def tcp_peer_stalls_mid_frame(
    rank: int, size: int, stall_s: float = 2.5
) -> list[tuple[str, float]]:
    """Rank 0 sends the header and 10 bytes of a 1000-byte message, then nothing for
    ``stall_s``, then the rest. Rank 1, whose waiting thread is reading that frame, still gets
    its timeout at its deadline; a retried wait completes with the whole message. Then rank 0
    stalls inside a message of another tag, and another thread of rank 1 aborts: the waiting
    thread's wait ends at once. Returns rank 1's (outcome, seconds) of the three waits."""
    from ddlcore.transports.tcp import _DATA, _HEADER, _MAGIC

    out: list[tuple[str, float]] = []
    with rank_env(rank, size, "tcp") as env:
        ctx = env.context()
        pair = ctx.pair(1 - rank)
        message = payload(0, 5, 0, 1000).tobytes()
        if rank == 0:
            env.barrier("posted")
            _tcp_write_raw(pair, _HEADER.pack(_MAGIC, _DATA, 0, 0, 5, 1000) + message[:10])
            time.sleep(stall_s)
            _tcp_write_raw(pair, message[10:])
            env.barrier("second")
            _tcp_write_raw(pair, _HEADER.pack(_MAGIC, _DATA, 0, 0, 7, 1000) + message[:10])
            env.barrier("done")
            return out
        got = np.empty(1000, np.uint8)
        req = pair.irecv(memoryview(got), 5)
        env.barrier("posted")
        t0 = time.monotonic()
        try:
            req.wait(1.0)
        except DDLTimeoutError as exc:
            out.append((f"timeout: {exc}", time.monotonic() - t0))
        else:
            raise AssertionError("the wait outlived its deadline inside a stalled frame")
        t0 = time.monotonic()
        req.wait(TIMEOUT_S + stall_s)
        out.append(("completed", time.monotonic() - t0))
        expect(got, 0, 5, 0)
        pending = pair.irecv(memoryview(bytearray(8)), 6)
        env.barrier("second")
        threading.Timer(0.5, lambda: ctx.abort(ABORT_OTHER, "stopped by another thread")).start()
        t0 = time.monotonic()
        try:
            pending.wait(3 * TIMEOUT_S)
        except DDLError as exc:
            assert not isinstance(exc, DDLTimeoutError), exc
            out.append((f"failed: {exc}", time.monotonic() - t0))
        else:
            raise AssertionError("the receive survived the abort")
        env.barrier("done")
        return out


def tcp_abort_while_a_message_is_half_in(rank: int, size: int) -> list[tuple[str, float]]:
    """Rank 0 sends half of the message rank 1 waits for, then stalls; another thread of rank 1
    aborts, then (on a second context) closes. The waiting thread, whose request the reader
    had already taken for that frame, fails at once each time. Returns rank 1's (outcome,
    seconds after the failure)."""
    from ddlcore.transports.tcp import _DATA, _HEADER, _MAGIC

    out: list[tuple[str, float]] = []
    with rank_env(rank, size, "tcp") as env:
        for how in ("abort", "close"):
            ctx = env.context(f"held-{how}")
            pair = _connected_pair(ctx, rank)
            if rank == 0:
                env.barrier(f"posted-{how}")
                _tcp_write_raw(pair, _HEADER.pack(_MAGIC, _DATA, 0, 0, 8, 1000) + bytes(10))
                env.barrier(f"checked-{how}")
                continue
            req = pair.irecv(memoryview(bytearray(1000)), 8)
            env.barrier(f"posted-{how}")
            # 0.5 s: the header is in by then, so the reader holds our request
            message, took = _failed_by_another_thread(ctx, req, how, 0.5)
            out.append((f"{how}: {message}", took))
            env.barrier(f"checked-{how}")
    return out


def shm_attach_as_the_peer_closes(rank: int, size: int, when: str) -> tuple[str, str, float]:
    """Rank 0 aborts, then closes; rank 1 reaches its inbox for the first time in the middle of
    that close: ``when`` "before" rank 0 refuses attaches (it must find rank 1 and tell it of
    the abort) or "after" (rank 1 must see the inbox closed). Either way rank 1's receive fails
    at once, never waiting out its deadline. Rank 1: (error class, message, seconds)."""
    with rank_env(rank, size, "shm") as env:
        ctx = env.context(f"seal-{when}")
        if rank == 0:
            ctx.abort(ABORT_MISMATCH, "the calls differ")
            seal = ctx._seal  # type: ignore[attr-defined]

            def let_rank_1_in() -> None:
                env.client.set(f"seal-{when}/closing", b"1")
                env.client.get(f"seal-{when}/reached", TIMEOUT_S)

            def sealing():
                if when == "before":
                    let_rank_1_in()
                pairs = seal()
                if when == "after":
                    let_rank_1_in()
                return pairs

            ctx._seal = sealing  # type: ignore[attr-defined]
            ctx.close()
            env.barrier("sealed")
            return ("", "", 0.0)
        env.client.get(f"seal-{when}/closing", TIMEOUT_S)
        t0 = time.monotonic()
        try:
            try:
                pair = ctx.pair(0)
            finally:
                env.client.set(f"seal-{when}/reached", b"1")
            pair.irecv(memoryview(bytearray(8)), 5).wait(TIMEOUT_S)
        except DDLError as exc:
            outcome = (type(exc).__name__, str(exc), time.monotonic() - t0)
        else:
            raise AssertionError("a receive from a rank that aborted and closed succeeded")
        env.barrier("sealed")
        return outcome
