"""`AgreeChannel`: one communicator's agreements (`agree.Agreement`) run over the control plane.

Every rank numbers its ``agree`` calls on a communicator 0, 1, 2, ...; call i on every rank is
instance i. The plane's threads drive the instances (a rank that decided answers the latecomers
even while its caller does something else), and `agree` only contributes and waits. An instance
a peer starts before this rank calls agree is created on its first message; decided instances
are kept for `_KEPT` calls after, to answer ranks still finishing them. Members lost stay lost:
each new instance starts from every loss seen so far, and from the dead each decision names.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

from ddlcore.errors import CommunicatorClosedError, DDLTimeoutError, ExcludedError
from ddlcore.resilience.agree import Agreement, Decision, Message
from ddlcore.resilience.control import CHANNEL_BYTES, Address, ControlPlane

_log = logging.getLogger("ddlcore")

_KEPT = 8  # decided instances kept, to answer ranks still in them
_AHEAD = 64  # how far past this rank's calls a peer's instance may be (a bound on state)
_PROBE_S = 0.02  # how often a waiting rank makes sure it watches whom it waits for
_FLUSH_S = 2.0  # how long agree waits for its decision's messages to leave (a dead peer's
#                 connection fails sooner; a hung one's fills only after many calls)


def channel_of(name: str) -> bytes:
    """The channel of the communicator named ``name`` (its namespace in the job's store: the
    same on every rank, distinct between communicators)."""
    return hashlib.sha256(b"ddlcore agree\0" + name.encode()).digest()[:CHANNEL_BYTES]


def excluded(rank: int, by: int | None) -> ExcludedError:
    """The error of rank ``rank`` whose plane was fenced (by rank ``by``, if a member)."""
    return ExcludedError(
        f"rank {rank}: the other ranks excluded this one"
        f"{'' if by is None else f' (rank {by} says so)'}: it was silent for longer than "
        "DDL_HEARTBEAT_TIMEOUT (stopped, hung or cut off) and they went on without it; it "
        "cannot take part again: exit (ddlrun --elastic starts a replacement)"
    )


class AgreeChannel:
    """The agreements of one communicator, as rank ``rank`` of the members at ``addresses`` (the
    ranks' control planes, in rank order)."""

    def __init__(self, plane: ControlPlane, name: str, rank: int, addresses: list[Address]) -> None:
        self._plane, self.rank, self.size = plane, rank, len(addresses)
        self.name = name
        self._channel = channel_of(name)
        self.addresses = addresses
        self._rank_of = {a: r for r, a in enumerate(addresses)}
        self._cond = threading.Condition()
        self._instances: dict[int, Agreement] = {}
        self._calls = 0  # agree calls made here: the next one is instance self._calls
        self.failed: set[int] = set()  # ranks lost, final (as this rank's detector saw)
        self.agreed_failed: frozenset[int] = frozenset()  # as the last decision named them
        self._closed = False
        plane.open_channel(self._channel, self, addresses)

    # --- the caller's side -------------------------------------------------------------------
    @property
    def calls(self) -> int:
        """How many times this rank called `agree` (the last call was instance calls - 1)."""
        return self._calls

    def agree(self, flag: bool, timeout: float) -> Decision:
        """This rank's part of the next instance: its decision, the same on every rank that
        decides.

        Raises
        ------
        DDLTimeoutError
            No decision within ``timeout`` (a member hung, or never called agree).
        CommunicatorClosedError
            The channel was closed.
        ExcludedError
            The other ranks excluded this one (it was silent too long): it decides nothing.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                raise CommunicatorClosedError(f"rank {self.rank}: agree on a closed communicator")
            self._check_fenced()
            instance = self._calls
            self._calls += 1
            state = self._instance(instance)
            assert state is not None
            self._send(instance, state.contribute(flag))
            probed = 0.0
            while state.decision is None:
                now = time.monotonic()
                left = deadline - now
                if left <= 0 or self._closed:
                    raise self._stuck(instance, state, timeout)
                if now - probed >= _PROBE_S:  # a rank waited on that died silent is found
                    probed = now
                    self._check_fenced()
                    for member in state.waiting_for():
                        self._plane.probe(self.addresses[member])
                self._cond.wait(min(left, _PROBE_S))
            decision = state.decision
            self.failed.update(decision.failed)
            self.agreed_failed = decision.failed
            for old in [i for i in self._instances if i < instance - _KEPT]:
                del self._instances[old]
        # The decision is out of this process before the caller may end it (a coordinator's
        # DECIDEs; the others' answers to ranks that took them for theirs).
        self._plane.flush(_FLUSH_S)
        return decision

    def _check_fenced(self) -> None:
        fenced = self._plane.fenced
        if fenced is not None:
            raise excluded(self.rank, self._rank_of.get(fenced))

    def _stuck(self, instance: int, state: Agreement, timeout: float) -> Exception:
        if self._closed:
            return CommunicatorClosedError(
                f"rank {self.rank}: agree #{instance}: the communicator was closed"
            )
        waiting = state.waiting_for()
        return DDLTimeoutError(
            f"rank {self.rank}: agree #{instance}: no decision within DDL_TIMEOUT={timeout:g} s; "
            f"waiting for rank(s) {waiting} (hung, or not calling agree #{instance}); lost so "
            f"far: {sorted(self.failed) or 'none'}"
        )

    # --- the plane's side (its threads) ------------------------------------------------------
    def on_frame(self, peer: Address, instance: int, kind: int, body: bytes) -> None:
        src = self._rank_of.get(peer)
        if src is None:
            _log.debug("rank %d: an agree frame from a non-member %s", self.rank, peer)
            return
        try:
            msg = Message.decode(kind, body, self.size)
        except ValueError as exc:
            _log.debug("rank %d: dropped an agree frame from rank %d: %s", self.rank, src, exc)
            return
        with self._cond:
            state = self._instance(instance)
            if state is None:
                return
            self._send(instance, state.receive(src, msg))
            self._cond.notify_all()

    def on_lost(self, peer: Address) -> None:
        member = self._rank_of.get(peer)
        if member is None:
            return
        with self._cond:
            self.failed.add(member)
            for instance, state in self._instances.items():
                self._send(instance, state.lost(member))
            self._cond.notify_all()

    def _instance(self, instance: int) -> Agreement | None:
        """Instance ``instance``'s state (created on first sight), or None for one too old or
        too far ahead (lock held)."""
        state = self._instances.get(instance)
        if state is None:
            if not self._calls - _KEPT - 1 <= instance < self._calls + _AHEAD:
                return None
            state = self._instances[instance] = Agreement(self.rank, self.size, self.failed)
        return state

    def _send(self, instance: int, out: list[tuple[int, Message]]) -> None:
        for dst, msg in out:
            self._plane.send(self.addresses[dst], self._channel, instance, msg.kind, msg.encode())

    def close(self) -> bool:
        """Stop; a caller waiting in `agree` raises. True: the plane has no channel left."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        return self._plane.close_channel(self._channel)
