"""Fault-tolerant agreement (ULFM's ``MPI_Comm_agree``) as a state machine: no I/O, no clock.

One `Agreement` is one member's side of one instance. Its caller feeds it the local flag
(`contribute`), the messages other members sent it (`receive`) and the deaths its failure
detector saw (`lost`); each call returns the messages to send. Every member that decides and
stays reachable decides the same `Decision`: the AND of the flags of every member that was
alive to contribute, and the members the deciding coordinator knew were dead. (Not uniform: a
member that decided, then left, counts as dead to the rest, who may decide without it.) The
detector must be perfect (a member called lost is gone, and every death is eventually
reported): the control plane reports a member lost when its listener refuses or its
connections close, which a live member's never do while it stays.

Rotating coordinator with adoption (the Paxos promise, over rounds in member order)::

    member m                                   coordinator c = lowest member m thinks alive
      contribute(flag) -- CONTRIB(c, flag) -->   waits for a CONTRIB from every member it
                                                 thinks alive (a coordinator that took over
                                                 asks the silent ones with COLLECT: a decided
                                                 member answers with its decision)
                       <-- DECIDE(c, D) ------   D = AND of the flags, and the dead it knew
      decided D

    failure-free cost: 2 (n - 1) messages of a few bytes, two hops.

* A member that sends CONTRIB to c promises c: it then ignores a DECIDE from any lower
  coordinator (which it, or c, saw die).
* A coordinator that hears of a decision (a decided member answers with it) adopts it and
  sends it on; it decides a value of its own only when every member it thinks alive has
  promised it and none reported a decision.
* When a member sees its coordinator die, it sends its CONTRIB to the next one.

Why every live member decides the same: say c decided D and sent it on, and c' > c decides
later. c' saw c die, and heard from every live member; each either holds D (accepted before it
promised c', so it reports D and c' adopts it) or promised c' first and so never accepts D.
Why it ends: failed sets only grow and the coordinator is their lowest complement, so after at
most n coordinators one lives long enough to hear from everyone.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

COLLECT, CONTRIB, DECIDE = 1, 2, 3
KINDS = (COLLECT, CONTRIB, DECIDE)

# Wire body of one message: coordinator i32 | flag u8 | has decision u8 | decided value u8 |
# 0 u8 | failed count u32 | decision's failed count u32, then the two lists of members (u32).
_BODY = struct.Struct("<iBBBBII")
_MEMBER = struct.Struct("<I")


@dataclass(frozen=True)
class Decision:
    """What an instance decided: ``value`` (the AND of the live members' flags) and ``failed``
    (the members its coordinator knew were dead; their flags do not count)."""

    value: bool
    failed: frozenset[int]


@dataclass(frozen=True)
class Message:
    """One agreement message; ``coordinator`` is the round it belongs to."""

    kind: int
    coordinator: int
    flag: bool = True
    failed: frozenset[int] = frozenset()
    decision: Decision | None = None

    def encode(self) -> bytes:
        d = self.decision
        head = _BODY.pack(
            self.coordinator,
            int(self.flag),
            int(d is not None),
            int(d is not None and d.value),
            0,
            len(self.failed),
            len(d.failed) if d is not None else 0,
        )
        members = sorted(self.failed) + (sorted(d.failed) if d is not None else [])
        return head + b"".join(_MEMBER.pack(m) for m in members)

    @classmethod
    def decode(cls, kind: int, body: bytes, size: int) -> Message:
        """The message in ``body``; ValueError if it is malformed or names a member outside
        ``[0, size)``."""
        if kind not in KINDS or len(body) < _BODY.size:
            raise ValueError(f"an agreement message of kind {kind} and {len(body)} bytes")
        coordinator, flag, has, value, _, nfailed, ndecided = _BODY.unpack_from(body)
        if (
            not 0 <= coordinator < size
            or nfailed > size
            or ndecided > size
            or len(body) != _BODY.size + 4 * (nfailed + ndecided)
        ):
            raise ValueError(f"a malformed agreement message ({len(body)} bytes, size {size})")
        members = [m for (m,) in _MEMBER.iter_unpack(body[_BODY.size :])]
        if any(m >= size for m in members):
            raise ValueError(f"an agreement message names a member outside [0, {size})")
        decision = Decision(bool(value), frozenset(members[nfailed:])) if has else None
        return cls(kind, coordinator, bool(flag), frozenset(members[:nfailed]), decision)


class Agreement:
    """One instance of agreement, as member ``me`` of ``size`` sees it.

    Parameters
    ----------
    me, size : int
        This member and how many there are (members are ``0 .. size-1``).
    failed : iterable of int
        Members known dead before the instance starts (an earlier decision's, or seen since).
    """

    def __init__(self, me: int, size: int, failed: Iterable[int] = ()) -> None:
        if not 0 <= me < size:
            raise ValueError(f"member {me} is not in [0, {size})")
        self.me, self.size = me, size
        self.failed: set[int] = {m for m in failed if m != me}
        self.flag: bool | None = None  # until the local caller contributes
        self.promised = -1  # the highest coordinator this member sent its CONTRIB to
        self.decision: Decision | None = None
        self._flags: dict[int, bool] = {}  # member -> flag, CONTRIBs sent to this member
        self._reported: Decision | None = None  # a decision a CONTRIB reported
        self._asked: set[int] = set()  # members this coordinator sent COLLECT

    def coordinator(self) -> int:
        """The lowest member this one thinks alive (itself, at worst)."""
        return next(m for m in range(self.size) if m not in self.failed)

    def waiting_for(self) -> list[int]:
        """Whom this member waits for: as coordinator, the live members that have not
        contributed; else its coordinator. Empty once decided."""
        if self.decision is not None:
            return []
        c = self.coordinator()
        if c != self.me:
            return [c]
        return [m for m in self._alive() if m != self.me and m not in self._flags]

    def contribute(self, flag: bool) -> list[tuple[int, Message]]:
        """The local caller's flag: the instance starts here."""
        if self.flag is not None:
            raise RuntimeError("this instance has its flag already")
        self.flag = bool(flag)
        return self._step()

    def receive(self, src: int, msg: Message) -> list[tuple[int, Message]]:
        """A message from member ``src``."""
        if msg.kind == DECIDE:
            if (
                self.decision is None
                and msg.decision is not None
                and msg.coordinator >= (self.promised)
            ):
                self.decision = msg.decision
                # Members that took us for their coordinator wait on us: tell them.
                decide = Message(DECIDE, self.me, decision=self.decision)
                return [(m, decide) for m in self._flags if m not in self.failed]
            return []
        if msg.kind == COLLECT:
            if self.decision is not None:  # tell it what was decided: it adopts it
                return [(src, self._contrib(msg.coordinator))]
            if (
                self.flag is not None
                and msg.coordinator >= self.promised
                and msg.coordinator != (self.me)
            ):
                self.promised = msg.coordinator
                return [(src, self._contrib(msg.coordinator))]
            return []  # it hears from us once we contribute, or learn that it leads
        # CONTRIB: src promised us
        if self.decision is not None:
            return [(src, Message(DECIDE, self.me, decision=self.decision))]
        if msg.decision is not None:
            self._reported = msg.decision
        if src not in self.failed:
            self._flags[src] = msg.flag
        return self._step()

    def lost(self, member: int) -> list[tuple[int, Message]]:
        """The failure detector saw ``member`` die."""
        if member == self.me or member in self.failed:
            return []
        self.failed.add(member)
        self._flags.pop(member, None)
        return self._step()

    def _alive(self) -> list[int]:
        return [m for m in range(self.size) if m not in self.failed]

    def _contrib(self, coordinator: int) -> Message:
        return Message(
            CONTRIB,
            coordinator,
            bool(self.flag),
            frozenset(self.failed),
            self.decision,
        )

    def _step(self) -> list[tuple[int, Message]]:
        if self.decision is not None or self.flag is None:
            return []
        c = self.coordinator()
        if c != self.me:
            if self.promised >= c:
                return []  # our CONTRIB went to c (or to a later round) already
            self.promised = c
            return [(c, self._contrib(c))]
        self.promised = self.me
        others = [m for m in self._alive() if m != self.me]
        if self._reported is not None:
            return self._decide(self._reported, others)
        missing = [m for m in others if m not in self._flags]
        if missing:
            if self.me == 0:
                # The first coordinator: nobody can have decided before it, and every member
                # sends it a CONTRIB unasked. A member that died silent is the caller's to
                # find (`AgreeChannel` dials those it waits on and holds no connection to).
                return []
            ask = [m for m in missing if m not in self._asked]
            self._asked.update(ask)
            return [(m, Message(COLLECT, self.me)) for m in ask]
        value = self.flag and all(self._flags[m] for m in others)
        return self._decide(Decision(value, frozenset(self.failed)), others)

    def _decide(self, decision: Decision, others: list[int]) -> list[tuple[int, Message]]:
        self.decision = decision
        return [(m, Message(DECIDE, self.me, decision=decision)) for m in others]
