"""Agreement: make every schedule prove, as it runs, that all ranks called the same collective.

Every message of a collective carries the call's check word (a hash of its kind, element count,
dtype, op and root), and a receive whose sender used another word fails with
`CollectiveMismatchError`. Two properties turn that into "every rank raises when any two ranks
disagree", whatever their calls (``tests/collectives/test_mismatch.py``):

* **First contact.** Each rank's first step sends to its ring successor (rank + 1) and its first
  wait is a receive from its ring predecessor (rank - 1), both slot 0 of their pair, whatever the
  call. Ranks that disagree include two ring neighbours that disagree, and the receiving one
  meets the other's first message (same tag, another check word or size): it raises and aborts
  its links, which fail its peers' waits with the same class. Without this, ranks running
  different schedules can each wait for a message the other never sends (a timeout, not a
  mismatch) or never receive at all (a broadcast with two roots: both only send).
* **Completeness.** A rank returns only after a chain of checked messages reached it from every
  rank. Then a rank that returns has met only matching words along each chain, so all ranks
  agreed: nobody finishes with another rank's idea of the call. Allreduce, reduce-scatter and
  allgather of at least one element have it by nature (each result depends on every input), the
  dissemination barrier too; a broadcast does not (the root hears from nobody), nor does an
  empty call (no messages at all).

`agreed` adds what a schedule lacks, as empty messages (the check word is the whole content)::

    first contact only:   send -> rank+1, [the schedule's leading sends], recv <- rank-1, rest
    broadcast, empty:     the dissemination rounds (round k: send -> rank+2^k, recv <-
                          rank-2^k; a root's sends go out with round 0's), then the rest

The first costs one empty message per rank, in flight beside the data; schedules that start
with a ring step (ring, and rd, rhd and ring at two ranks but for a few elements) have it
already and get nothing. The second makes a broadcast wait about log2 P message latencies
longer: its root used to return as soon as its sends were queued.

The other paths (`Communicator`): the host's boards compare every local rank's call at each
sync point (complete by nature). Over several hosts every path begins with such a sync, so the
ranks of one host never take different paths, and the host-staged rings across hosts make
first contact with an empty message (their peers are not ring neighbours). Transports without
check words on the wire (MPI) cannot judge any of these messages: there `engine.agree`
exchanges the calls' descriptions explicitly, before the schedule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ddlcore.algorithms.schedule import Buf, Kind, Schedule, Step
from ddlcore.collectives import Collective


def sends_first(sched: Schedule) -> bool:
    """Whether ``sched``'s first step sends slot 0 to rank + 1 (before any wait)."""
    steps, nxt = sched.steps, (sched.rank + 1) % sched.size
    return (
        bool(steps) and steps[0].kind == Kind.SEND and steps[0].peer == nxt and steps[0].slot == 0
    )


def waits_first(sched: Schedule) -> bool:
    """Whether ``sched``'s first receive is slot 0 from rank - 1 (only sends and copies before
    it, which do not wait for a peer)."""
    prv = (sched.rank - 1) % sched.size
    for s in sched.steps:
        if s.kind == Kind.RECV or s.kind == Kind.RECV_REDUCE:
            return s.peer == prv and s.slot == 0
    return False


def _shifted(steps: Sequence[Step], pairs: set[tuple[bool, int]], by: int) -> list[Step]:
    """``steps`` with the slots of the messages on ``pairs`` ((is_send, peer)) moved up by
    ``by``, leaving room for the agreement's messages at slots 0 .. by-1."""
    out = []
    for s in steps:
        if s.kind != Kind.COPY and (s.kind == Kind.SEND, s.peer) in pairs:
            s = s.with_slot(s.slot + by)
        out.append(s)
    return out


def _empty(kind: Kind, peer: int, slot: int) -> Step:
    if kind == Kind.SEND:
        return Step(Kind.SEND, peer, slot, 0, Buf.OUTPUT, 0)
    return Step(Kind.RECV, peer, slot, 0, dst=Buf.OUTPUT, dst_off=0)


def dissemination_rounds(size: int) -> list[int]:
    """The distances 1, 2, 4 ... < size of the dissemination rounds (distinct peers)."""
    out, dist = [], 1
    while dist < size:
        out.append(dist)
        dist *= 2
    return out


def agreed(
    make: Callable[[int], Schedule], rank: int, size: int, complete: bool, hello: bool | None = None
) -> Schedule:
    """Rank ``rank``'s schedule (``make(r)`` makes rank r's) with what first contact and
    completeness need added. ``complete``: the call has completeness by nature (the same on
    every rank: a function of the call, not of one rank's part of it). ``hello``: True adds
    the empty first messages whatever the schedules (the host-staged rings, whose ranks are not
    ring neighbours), False never (later segments of one call), None decides as below.

    Whether the pair (r, r + 1) needs an empty first message depends on both ends' schedules
    (r's first step, r + 1's first receive), so a rank also makes its neighbours' schedules
    to decide as they do."""
    sched = make(rank)
    if size < 2:
        return sched
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    if not complete:
        # Each rank is a distance from at most one peer per round (distances are distinct
        # powers of two below size), so each round's messages take slot 0 of their pair.
        head: list[Step] = []
        ahead: set[tuple[bool, int]] = set()
        for dist in dissemination_rounds(size):
            to, frm = (rank + dist) % size, (rank - dist) % size
            head += [_empty(Kind.SEND, to, 0), _empty(Kind.RECV, frm, 0)]
            ahead |= {(True, to), (False, frm)}
        rest = _shifted(sched.steps, ahead, 1)
        # A root's sends go out with round 0's: the data is on its way while the rounds run.
        lead = next((i for i, s in enumerate(rest) if s.kind != Kind.SEND), len(rest))
        steps = head[:1] + rest[:lead] + head[1:] + rest[lead:]
        return dataclasses.replace(sched, steps=tuple(steps))
    if hello is None:
        hello_out = not (sends_first(sched) and waits_first(make(nxt)))
        hello_in = not (sends_first(make(prv)) and waits_first(sched))
    else:
        hello_out = hello_in = hello
    if not hello_out and not hello_in:
        return sched
    rest = _shifted(
        sched.steps,
        ({(True, nxt)} if hello_out else set()) | ({(False, prv)} if hello_in else set()),
        1,
    )
    first_recv = next(
        (i for i, s in enumerate(rest) if s.kind == Kind.RECV or s.kind == Kind.RECV_REDUCE),
        len(rest),
    )
    steps = (
        ([_empty(Kind.SEND, nxt, 0)] if hello_out else [])
        + rest[:first_recv]
        + ([_empty(Kind.RECV, prv, 0)] if hello_in else [])
        + rest[first_recv:]
    )
    return dataclasses.replace(sched, steps=tuple(steps))


def natural_completeness(collective: str, count: int, size: int = 1) -> bool:
    """Whether a ``collective`` of ``count`` input elements (per rank; ``size`` ranks) has
    completeness by nature: the barrier, the reductions, allgather and alltoall of at least one
    element, and reduce where every rank's ring segment has one (its ring reduce-scatter is
    complete; gather, scatter and alltoallv never are: a non-root hears only from the root)."""
    if collective == Collective.REDUCE:
        return count >= size
    if collective in (Collective.GATHER, Collective.SCATTER, Collective.ALLTOALLV):
        return False
    return collective == Collective.BARRIER or (collective != Collective.BROADCAST and count > 0)
