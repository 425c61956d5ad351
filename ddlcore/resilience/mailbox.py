"""`Mailbox`: one-off messages between a communicator's ranks over the control plane, beside
its agreements: each frame is kept by (sender, instance, kind) until taken, and a wait for one
ends when it comes, when its sender is lost, or at a deadline. Watches (`watch`) hear, on the
plane's thread, of every rank lost from then on (instance `LOST`) and of every frame of an
alarm kind (its sender and instance), which is not kept.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ddlcore.resilience.channel import channel_of
from ddlcore.resilience.control import Address, ControlPlane

_MAX_KEPT = 1024  # frames kept untaken (a bound on what peers can make us hold)
_MAX_BODY = 256  # the longest message kept (a port today)
LOST = -1  # a watch's instance for a rank lost


class Mailbox:
    """The mailbox of rank ``rank`` among the ranks whose planes are at ``addresses``, on the
    channel named ``name``."""

    def __init__(
        self,
        plane: ControlPlane,
        name: str,
        rank: int,
        addresses: list[Address],
        alarms: tuple[int, ...] = (),
    ) -> None:
        self._plane, self.rank, self._alarms = plane, rank, alarms
        self._channel = channel_of(name)
        self._addresses = addresses
        self._rank_of = {a: r for r, a in enumerate(addresses)}
        self._cond = threading.Condition()
        self._frames: dict[tuple[int, int, int], bytes] = {}
        self.lost: set[int] = set()
        self._watches: list[Callable[[int, int], None]] = []
        self._closed = False
        plane.open_channel(self._channel, self, addresses)

    def post(self, dst: int, instance: int, kind: int, body: bytes) -> None:
        self._plane.send(self._addresses[dst], self._channel, instance, kind, body)

    def take(self, src: int, instance: int, kind: int, deadline: float) -> bytes | None:
        """The frame ``src`` sent for (``instance``, ``kind``); None when ``src`` was lost
        first, or at ``deadline`` (``time.monotonic``)."""
        key = (src, instance, kind)
        with self._cond:
            while key not in self._frames:
                left = deadline - time.monotonic()
                if src in self.lost or self._closed or left <= 0:
                    return None
                self._cond.wait(left)
            return self._frames.pop(key)

    def watch(self, fn: Callable[[int, int], None]) -> Callable[[], None]:
        """Call ``fn(rank, LOST)`` for each rank lost from now on (and at once for those lost
        already), ``fn(rank, instance)`` for each alarm; returns what stops it."""
        with self._cond:
            self._watches.append(fn)
            lost = sorted(self.lost)
        for rank in lost:
            fn(rank, LOST)

        def stop() -> None:
            with self._cond:
                if fn in self._watches:
                    self._watches.remove(fn)

        return stop

    # --- the plane's side --------------------------------------------------------------------
    def on_frame(self, peer: Address, instance: int, kind: int, body: bytes) -> None:
        src = self._rank_of.get(peer)
        if src is None:
            return
        if kind in self._alarms:
            with self._cond:
                watches = list(self._watches)
            for fn in watches:
                fn(src, instance)
            return
        if len(body) > _MAX_BODY:
            return  # no message of ours is that long
        with self._cond:
            if len(self._frames) >= _MAX_KEPT:
                self._frames.pop(next(iter(self._frames)))
            self._frames[(src, instance, kind)] = body
            self._cond.notify_all()

    def on_lost(self, peer: Address) -> None:
        rank = self._rank_of.get(peer)
        if rank is None:
            return
        with self._cond:
            if rank in self.lost:
                return
            self.lost.add(rank)
            watches = list(self._watches)
            self._cond.notify_all()
        for fn in watches:
            fn(rank, LOST)

    def close(self) -> bool:
        """Stop; True when the plane has no channel left."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return self._plane.close_channel(self._channel)
