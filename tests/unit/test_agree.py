"""`ddlcore.resilience.agree`: the agreement state machine over an in-memory network that
delivers messages in any order, crashes members at any point (a crashed member's messages in
flight are each lost or not) and reports each death to each survivor at any later moment.
Every live member must decide, all on the same decision, and the decision must be the AND of
the flags of members that include every survivor; and the wire form must round-trip and refuse
what is malformed."""

from __future__ import annotations

import random

import pytest

from ddlcore.resilience.agree import (
    COLLECT,
    CONTRIB,
    DECIDE,
    Agreement,
    Decision,
    Message,
)


def _run(seed: int, n: int, crashes: int) -> tuple[dict[int, Decision], set[int], list[bool]]:
    """One random execution: (decision of each survivor, the crashed, the flags)."""
    rng = random.Random(seed)
    flags = [rng.random() < 0.8 for _ in range(n)]
    members = [Agreement(m, n) for m in range(n)]
    in_flight: list[tuple[int, int, Message]] = []
    notices: list[tuple[int, int]] = []  # (observer, dead): the detector's reports to come
    crashed: set[int] = set()
    to_contribute = list(range(n))
    victims = rng.sample(range(n), min(crashes, n - 1))

    def post(src: int, out: list[tuple[int, Message]]) -> None:
        for dst, msg in out:
            assert dst != src and 0 <= dst < n
            in_flight.append((src, dst, msg))

    steps = 0
    while in_flight or notices or to_contribute or victims:
        steps += 1
        assert steps < 100_000, "no progress"
        choices = ["deliver"] * len(in_flight) + ["notice"] * len(notices)
        choices += ["contribute"] * len(to_contribute)
        if victims:
            choices.append("crash")
        what = rng.choice(choices)
        if what == "deliver":
            src, dst, msg = in_flight.pop(rng.randrange(len(in_flight)))
            if dst not in crashed:
                post(dst, members[dst].receive(src, msg))
        elif what == "notice":
            observer, dead = notices.pop(rng.randrange(len(notices)))
            if observer not in crashed:
                post(observer, members[observer].lost(dead))
        elif what == "contribute":
            m = to_contribute.pop(rng.randrange(len(to_contribute)))
            if m not in crashed:
                post(m, members[m].contribute(flags[m]))
        else:
            dead = victims.pop()
            crashed.add(dead)
            in_flight = [f for f in in_flight if f[0] != dead or rng.random() < 0.5]
            notices += [(m, dead) for m in range(n) if m not in crashed]
    decisions = {m: members[m].decision for m in range(n) if m not in crashed}
    for m, d in decisions.items():
        assert d is not None, f"seed {seed}: member {m} never decided"
    return decisions, crashed, flags  # type: ignore[return-value]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("crashes", [0, 1, 2, 3])
def test_every_survivor_decides_the_same(n, crashes):
    for seed in range(400):
        decisions, crashed, flags = _run(seed * 31 + n, n, crashes)
        assert len(set(decisions.values())) == 1, (seed, decisions, crashed)
        decision = next(iter(decisions.values()))
        assert decision.failed <= crashed, (seed, decision, crashed)
        survivors = [m for m in range(n) if m not in crashed]
        if decision.value:  # every survivor contributed: none said False
            assert all(flags[m] for m in survivors), (seed, decision, flags)
        if all(flags):
            assert decision.value, (seed, decision)
        if not crashes:
            assert decision == Decision(all(flags), frozenset())


def test_failure_free_cost_is_two_hops():
    """Without failures: n-1 CONTRIBs to member 0, n-1 DECIDEs back; no COLLECT."""
    n = 6
    members = [Agreement(m, n) for m in range(n)]
    sent = []
    for m in range(1, n):
        sent += [(m, dst, msg) for dst, msg in members[m].contribute(True)]
    assert sent == [(m, 0, Message(CONTRIB, 0, True)) for m in range(1, n)]
    decides = []
    for m in range(1, n):
        assert members[0].receive(m, sent[m - 1][2]) == []
    decides = members[0].contribute(True)
    assert [dst for dst, _ in decides] == list(range(1, n))
    assert all(msg.kind == DECIDE for _, msg in decides)
    for dst, msg in decides:
        assert members[dst].receive(0, msg) == []
        assert members[dst].decision == Decision(True, frozenset())


def test_a_coordinator_asks_the_silent_and_adopts_a_reported_decision():
    """Member 0 decided and died having told only member 2: member 1 takes over, asks the
    members it has not heard from (a dead one's listener refuses: the detector says so), and
    adopts member 2's decision rather than decide its own."""
    n = 4
    members = [Agreement(m, n) for m in range(n)]
    told = Decision(False, frozenset())
    members[2].contribute(True)
    members[2].receive(0, Message(DECIDE, 0, decision=told))
    assert members[2].decision == told
    out = members[1].contribute(True)
    assert out == [(0, Message(CONTRIB, 0, True))]
    out = members[1].lost(0)
    assert sorted((dst, msg.kind) for dst, msg in out) == [(2, COLLECT), (3, COLLECT)]
    answer = members[2].receive(1, Message(COLLECT, 1))
    assert answer == [(1, Message(CONTRIB, 1, True, frozenset(), told))]
    out = members[1].receive(2, answer[0][1])
    assert members[1].decision == told
    assert sorted(dst for dst, _ in out) == [2, 3]


def test_a_member_ignores_the_decision_of_a_coordinator_it_outgrew():
    """Once member 2 promised coordinator 1, a late DECIDE from coordinator 0 is ignored."""
    m = Agreement(2, 3)
    m.contribute(True)
    m.lost(0)
    assert m.promised == 1
    m.receive(0, Message(DECIDE, 0, decision=Decision(False, frozenset())))
    assert m.decision is None
    m.receive(1, Message(DECIDE, 1, decision=Decision(True, frozenset({0}))))
    assert m.decision == Decision(True, frozenset({0}))


@pytest.mark.parametrize(
    "msg",
    [
        Message(COLLECT, 3),
        Message(CONTRIB, 0, False, frozenset({1, 5})),
        Message(CONTRIB, 2, True, frozenset(), Decision(False, frozenset({4}))),
        Message(DECIDE, 1, decision=Decision(True, frozenset({0, 6}))),
    ],
)
def test_messages_round_trip(msg):
    assert Message.decode(msg.kind, msg.encode(), 7) == msg


def test_malformed_messages_are_refused():
    good = Message(CONTRIB, 1, True, frozenset({2})).encode()
    for kind, body, size in [
        (9, good, 4),  # no such kind
        (CONTRIB, good[:5], 4),  # short
        (CONTRIB, good + b"\0", 4),  # a trailing byte
        (CONTRIB, good, 2),  # names member 2 of 2
        (CONTRIB, Message(CONTRIB, 5).encode(), 4),  # coordinator out of range
    ]:
        with pytest.raises(ValueError):
            Message.decode(kind, body, size)
