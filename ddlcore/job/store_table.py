"""The rendezvous store's contents and their rules, without I/O: values (one set with
``readers=n`` goes after its n-th read), counters, waits parked until a key is set or a counter
reaches a target, and barriers served whole (their state goes once every rank is answered).
Everything goes when the last client leaves (`clear`). A value whose readers are not known
beforehand (a transport's address, read lazily by the peers that connect to it, maybe after its
owner left, as UCX's wire-up does) stays until then, within ``max_bytes``.

The server (``store_server``) hands it each request; it answers through the ``answer`` callback
given to it, now or when a wait ends, and asks for a wait's deadline through ``timer``. A client
here is any object with a ``wait`` attribute: the `Wait` parked for it, or None.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddlcore.job import store_wire as wire


@dataclass(eq=False)
class Wait:
    conn: Any
    op: int
    key: str
    arg: int


@dataclass(eq=False)
class _Entry:
    value: bytes
    readers: int  # reads left before the value is freed; 0: no limit


@dataclass(eq=False)
class _Barrier:
    size: int
    arrived: bytearray  # bitmap
    count: int = 0
    answered: int = 0
    waiting: list[Wait] = field(default_factory=list)


class StoreTable:
    """Keys, values, waits and barriers of one store.

    Parameters
    ----------
    answer : callable
        ``answer(conn, status, value, arg)`` sends a reply (and clears ``conn.wait``).
    timer : callable
        ``timer(when, wait)``: call `expire` with ``wait`` at ``when`` (``time.monotonic``),
        unless it was answered or left by then.
    max_bytes : int
        Most bytes of values held at once; a SET past it is answered with an error.
    """

    def __init__(
        self,
        answer: Callable[[Any, int, bytes, int], None],
        timer: Callable[[float, object], None],
        max_bytes: int,
    ) -> None:
        self._answer_fn, self._timer, self.max_bytes = answer, timer, max_bytes
        self._data: dict[str, _Entry] = {}
        self._stored = 0
        self._waiters: dict[str, list[Wait]] = {}
        self._barriers: dict[str, _Barrier] = {}
        self.failed: str | None = None  # why the job failed at the store (`fail`)
        self.barriers_met = 0  # barriers every rank has reached: the job is past its start

    def _answer(self, conn: Any, status: int, value: bytes = b"", arg: int = 0) -> None:
        self._answer_fn(conn, status, value, arg)

    def clear(self) -> None:
        """Forget every value and barrier (the job has left)."""
        self._data.clear()
        self._barriers.clear()
        self._stored = 0

    def fail(self, why: str) -> None:
        """The job failed at its start (two processes claim a rank, the secrets differ): answer
        every parked wait, and every request from now on (for the store's life: a rank that
        comes late hears it too), FAILED with ``why``, so that every rank hears it at once
        instead of waiting out its timeout."""
        if self.failed is None:
            self.failed = why
        reason = self.failed.encode("utf-8", "replace")
        waits = [w for ws in self._waiters.values() for w in ws]
        waits += [w for b in self._barriers.values() for w in b.waiting]
        self._waiters.clear()
        self._barriers.clear()
        for wait in waits:
            if wait.conn.wait is wait:
                self._answer(wait.conn, wire.FAILED, reason)

    def stats(self) -> dict[str, int]:
        return {
            "keys": len(self._data),
            "bytes": self._stored,
            "barriers": len(self._barriers),
            "waits": sum(len(w) for w in list(self._waiters.values())),
        }

    def request(self, conn: Any, op: int, key: str, value: bytes, arg: int, wait_s: float) -> None:
        """Serve one request of ``conn`` (answered now, or parked until ``wait_s`` passes)."""
        if self.failed is not None:
            self._answer(conn, wire.FAILED, self.failed.encode("utf-8", "replace"))
        elif op == wire.SET:
            self._set(conn, key, value, max(0, arg))
        elif op == wire.GET:
            if not self._try_get(conn, key):
                self._park(conn, wire.GET, key, 0, wait_s)
        elif op == wire.CHECK:
            self._answer(conn, wire.OK if key in self._data else wire.MISSING)
        elif op == wire.DELETE:
            entry = self._data.pop(key, None)
            if entry is not None:
                self._stored -= len(entry.value)
            self._answer(conn, wire.MISSING if entry is None else wire.OK)
        elif op == wire.ADD:
            self._add(conn, key, arg)
        elif op == wire.WAIT_GE:
            current = self._counter(conn, key)
            if current is None:
                return
            if current >= arg:
                self._answer(conn, wire.OK, b"", current)
            else:
                self._park(conn, wire.WAIT_GE, key, arg, wait_s)
        else:
            self._barrier(conn, key, arg, wait_s)

    def _set(self, conn: Any, key: str, value: bytes, readers: int) -> None:
        old = self._data.get(key)
        grown = self._stored - (len(old.value) if old else 0) + len(value)
        if grown > self.max_bytes:
            self._answer(
                conn,
                wire.ERROR,
                f"the store holds {self._stored} bytes; storing "
                f"{len(value)} more under {key!r} would pass its cap of "
                f"{self.max_bytes}".encode(),
            )
            return
        self._stored = grown
        self._data[key] = _Entry(value, readers)
        self._wake(key)  # first: the value may be read out (readers) before the setter hears
        self._answer(conn, wire.OK)

    def _try_get(self, conn: Any, key: str) -> bool:
        entry = self._data.get(key)
        if entry is None:
            return False
        if entry.readers:
            entry.readers -= 1
            if not entry.readers:
                self._free(key)
        self._answer(conn, wire.OK, entry.value)
        return True

    def _counter(self, conn: Any, key: str) -> int | None:
        entry = self._data.get(key)
        if entry is None:
            return 0
        try:
            return int(entry.value)
        except ValueError:
            self._answer(conn, wire.ERROR, f"key {key!r} does not hold a counter".encode())
            return None

    def _add(self, conn: Any, key: str, amount: int) -> None:
        current = self._counter(conn, key)
        if current is None:
            return
        current += amount
        old = self._data.get(key)
        value = str(current).encode()
        self._stored += len(value) - (len(old.value) if old else 0)
        self._data[key] = _Entry(value, 0)
        self._wake(key)
        self._answer(conn, wire.OK, b"", current)

    def _free(self, key: str) -> None:
        entry = self._data.pop(key, None)
        if entry is not None:
            self._stored -= len(entry.value)

    def _park(self, conn: Any, op: int, key: str, arg: int, wait_s: float) -> None:
        if wait_s <= 0:
            self.expire(Wait(conn, op, key, arg))
            return
        wait = Wait(conn, op, key, arg)
        conn.wait = wait
        self._waiters.setdefault(key, []).append(wait)
        self._timer(time.monotonic() + wait_s, wait)

    def _wake(self, key: str) -> None:
        waits = self._waiters.pop(key, None)
        if not waits:
            return
        still = []
        for wait in waits:  # (answering cannot park or unpark: the list is ours alone)
            conn = wait.conn
            if conn.wait is not wait:
                continue
            if wait.op == wire.GET:
                if not self._try_get(conn, key):
                    still.append(wait)
            else:
                current = self._counter(conn, key)
                if current is None:
                    continue  # answered with an error
                if current >= wait.arg:
                    self._answer(conn, wire.OK, b"", current)
                else:
                    still.append(wait)
        if still:
            self._waiters.setdefault(key, []).extend(still)

    def leave(self, wait: Wait) -> None:
        """Forget ``wait`` (its client left, or its time is up)."""
        if wait.op == wire.BARRIER:
            barrier = self._barriers.get(wait.key)
            if barrier is not None and wait in barrier.waiting:
                barrier.waiting.remove(wait)
                barrier.answered += 1
                self._retire(wait.key, barrier)
            return
        waits = self._waiters.get(wait.key)
        if waits is not None and wait in waits:
            waits.remove(wait)
            if not waits:
                del self._waiters[wait.key]

    def expire(self, wait: Wait) -> None:
        """Answer a wait whose time is up: MISSING, with what there is to say."""
        barrier = self._barriers.get(wait.key) if wait.op == wire.BARRIER else None
        self.leave(wait)
        conn = wait.conn
        if wait.op == wire.BARRIER:
            self._answer(
                conn,
                wire.MISSING,
                bytes(barrier.arrived) if barrier else b"",
                barrier.count if barrier else 0,
            )
        elif wait.op == wire.WAIT_GE:
            current = self._counter(conn, wait.key)
            if current is not None:
                self._answer(conn, wire.MISSING, b"", current)
        else:
            self._answer(conn, wire.MISSING)

    def _barrier(self, conn: Any, key: str, arg: int, wait_s: float) -> None:
        size, rank = arg >> 32, arg & 0xFFFFFFFF
        if not 0 < size <= wire.MAX_BARRIER_SIZE or rank >= size:
            self._answer(conn, wire.ERROR, f"barrier {key!r}: rank {rank} of {size}".encode())
            return
        barrier = self._barriers.get(key)
        if barrier is None:
            barrier = self._barriers[key] = _Barrier(size, bytearray((size + 7) // 8))
        if barrier.size != size:
            self._answer(
                conn,
                wire.ERROR,
                f"barrier {key!r}: rank {rank} says {size} ranks, "
                f"an earlier one said {barrier.size}".encode(),
            )
            return
        byte, bit = rank >> 3, 1 << (rank & 7)
        if barrier.arrived[byte] & bit:
            self._answer(
                conn,
                wire.ERROR,
                f"barrier {key!r}: rank {rank} arrived twice (two "
                "processes claim that rank, or it called the barrier twice)".encode(),
            )
            return
        barrier.arrived[byte] |= bit
        barrier.count += 1
        if barrier.count < size:
            wait = Wait(conn, wire.BARRIER, key, arg)
            conn.wait = wait
            barrier.waiting.append(wait)
            self._timer(time.monotonic() + wait_s, wait)
            return
        waiting, barrier.waiting = barrier.waiting, []
        self.barriers_met += 1
        barrier.answered += len(waiting) + 1
        self._retire(key, barrier)  # first: a rank answered may look at once
        for wait in waiting:
            self._answer(wait.conn, wire.OK, b"", size)
        self._answer(conn, wire.OK, b"", size)

    def _retire(self, key: str, barrier: _Barrier) -> None:
        if barrier.answered >= barrier.size:
            del self._barriers[key]
