"""Abort notes (`ddlcore.job.abort_notes`): what a rank that left says, and what a rank that
finds it gone makes of it, with a store of dicts (no processes)."""

from __future__ import annotations

import threading

import pytest
from ddlcore.transports.base import MAX_ABORT_REASON_BYTES
from ddlcore.transports.common import ABORT_MISMATCH, ABORT_TIMEOUT

from ddlcore.errors import (
    CollectiveMismatchError,
    DDLError,
    DDLTimeoutError,
    PeerFailureError,
    RendezvousError,
    abort_reason,
)
from ddlcore.job import abort_notes


class _Store:
    """The two calls notes use, on a dict; ``fail``: every call raises it."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.values: dict[str, bytes] = {}
        self.fail = fail
        self.posted = threading.Event()

    def post(self, key: str, value: bytes, within_s: float) -> None:
        if self.fail is not None:
            raise self.fail
        self.values[key] = bytes(value)
        self.posted.set()

    def lookup(self, key: str, within_s: float) -> bytes | None:
        if self.fail is not None:
            raise self.fail
        return self.values.get(key)


def _gone(peer: int = 1) -> PeerFailureError:
    return PeerFailureError(f"could not connect to rank {peer}: refused", peer)


def test_a_note_posted_once_turns_a_gone_peer_into_its_abort():
    store = _Store()
    note = abort_notes.Note(store, rank=1)
    note.post(ABORT_MISMATCH, "rank 1 called allreduce, rank 2 called broadcast")
    note.post(ABORT_TIMEOUT, "a later abort is not the cause")
    note.wait()
    assert list(store.values) == ["abort/1"]
    err = abort_notes.explain(_gone(), 0, store)
    assert isinstance(err, CollectiveMismatchError)
    assert str(err) == "rank 1 aborted: rank 1 called allreduce, rank 2 called broadcast"
    assert err.origin == 1


def test_a_relayed_abort_keeps_the_rank_it_started_at():
    store = _Store()
    told = DDLTimeoutError("rank 3 waited 20 s")
    told.origin, told.cause = 3, "rank 3 aborted: rank 3 waited 20 s"
    abort_notes.Note(store, rank=1).post(ABORT_TIMEOUT, abort_reason(told, "unused"))
    assert store.posted.wait(5)
    err = abort_notes.explain(_gone(), 0, store)
    assert isinstance(err, DDLTimeoutError) and err.origin == 3
    assert str(err) == "rank 3 aborted: rank 3 waited 20 s (reported by rank 1)"


@pytest.mark.parametrize(
    "exc",
    [
        DDLTimeoutError("not a peer that is gone"),
        PeerFailureError("blames nobody"),
        PeerFailureError("blames us", 0),
    ],
)
def test_only_a_peer_gone_without_a_word_is_looked_up(exc):
    store = _Store()
    store.values["abort/0"] = abort_notes.note_bytes(ABORT_MISMATCH, "never read")
    assert abort_notes.explain(exc, 0, store) is exc


def test_what_a_peer_told_stands():
    told = PeerFailureError("rank 1 aborted: it told us itself", 1)
    told.origin = 1
    store = _Store()
    store.values["abort/1"] = abort_notes.note_bytes(ABORT_MISMATCH, "another story")
    assert abort_notes.explain(told, 0, store) is told


@pytest.mark.parametrize(
    "store",
    [
        _Store(),  # no note: the peer died without aborting
        _Store(fail=RendezvousError("busy")),
        _Store(fail=OSError("gone")),
        object(),  # a store that cannot look up
    ],
)
def test_without_a_readable_note_what_we_saw_stands(store):
    gone = _gone()
    assert abort_notes.explain(gone, 0, store) is gone
    abort_notes.Note(store, rank=0).post(ABORT_MISMATCH, "posting never raises")


@pytest.mark.parametrize("note", [b"", b"\x01\x00"])
def test_a_note_too_short_is_no_explanation(note):
    assert abort_notes.from_note(note, 1) is None


def test_an_origin_that_is_no_rank_is_read_as_text():
    raw = abort_notes.note_bytes(ABORT_TIMEOUT, "\x1e\u00b2\x1ecause")  # origin "²"
    err = abort_notes.from_note(raw, 1)
    assert isinstance(err, DDLTimeoutError) and err.origin == 1


def test_notes_are_capped_and_any_text_is_taken():
    long = "x" * (3 * MAX_ABORT_REASON_BYTES)
    raw = abort_notes.note_bytes(ABORT_MISMATCH, long + "\udc80")  # a lone surrogate too
    assert len(raw) == 4 + MAX_ABORT_REASON_BYTES
    err = abort_notes.from_note(raw + b"more than any note holds", 2)
    assert isinstance(err, CollectiveMismatchError)
    assert len(str(err)) <= MAX_ABORT_REASON_BYTES + len("rank 2 aborted: ")
    unknown = abort_notes.from_note(abort_notes.note_bytes(99, "a code we do not know"), 2)
    assert isinstance(unknown, DDLError)
