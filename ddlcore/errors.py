"""The error hierarchy: every error ddlcore raises on its own account derives from `DDLError`.

Bad arguments are reported with the builtin `ValueError`/`TypeError` (naming the argument) before
any communication starts; failures of the job itself (a peer died, a collective disagreed across
ranks, a deadline passed, rendezvous failed) are `DDLError` subclasses whose message says which
rank, which collective, its sequence number, and what to do.
"""

from __future__ import annotations


class DDLError(RuntimeError):
    """Base class of every ddlcore failure that is not a plain argument error."""


class DDLTimeoutError(DDLError, TimeoutError):
    """A blocking wait passed its deadline (``DDL_TIMEOUT``)."""


class PeerFailureError(DDLError):
    """A peer closed its connection, died, or reported that it aborted.

    ``peer`` is the rank that failed first, also when another rank relayed the failure to us
    (aborts carry their origin: `abort_reason`); ``cause`` is that failure in the words of the
    rank that saw it (None: this error's own message is the cause)."""

    def __init__(self, message: str, peer: int | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.cause = cause


class CollectiveMismatchError(DDLError):
    """Ranks called collectives that disagree (size, dtype, op, root or kind)."""


class RendezvousError(DDLError):
    """The ranks could not find each other at init (store unreachable, not all ranks joined)."""


class TransportUnavailableError(DDLError):
    """A transport was asked for but cannot run here; the message says why."""


class CommunicatorClosedError(DDLError):
    """The communicator was closed, or broken by an earlier failure, and cannot run collectives."""


class ParametersDifferError(DDLError):
    """Data-parallel training found the ranks' parameters different where they must be equal
    (the PyTorch `DistributedOptimizer` checks at its first step)."""


# --- relaying a failure: the origin travels with the abort reason ----------------------------
# A rank that aborts because of a peer's failure tells its own peers which rank failed first and
# how, so every rank's PeerFailureError names the origin (not the rank that relayed it) and says
# the cause once. The origin rides in front of the reason, between record separators (a byte no
# message of ours contains; not NUL, which native code may stop at).
_MARK = "\x1e"


def root_cause(exc: BaseException) -> str:
    """What failed first, as the rank that saw it said it."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, str) else str(exc)


def rewrap(exc: DDLError, message: str) -> DDLError:
    """An error of ``exc``'s class with ``message`` (more context around ``exc``), keeping whom a
    `PeerFailureError` blames and its cause."""
    err = type(exc)(message)
    if isinstance(exc, PeerFailureError) and isinstance(err, PeerFailureError):
        err.peer, err.cause = exc.peer, root_cause(exc)
    return err


def abort_reason(exc: BaseException, reason: str) -> str:
    """The reason to send peers when aborting because of ``exc``: ``reason`` (our account of the
    failure, without our "rank R: " prefix), or, for a peer's failure, its origin and cause."""
    peer = getattr(exc, "peer", None) if isinstance(exc, PeerFailureError) else None
    if isinstance(peer, int) and peer >= 0:
        return f"{_MARK}{peer}{_MARK}{root_cause(exc)}"
    return reason


def parse_reason(reason: str) -> tuple[int | None, str]:
    """(origin rank or None, text) of an abort reason made by `abort_reason`."""
    if reason.startswith(_MARK):
        origin, mark, text = reason[1:].partition(_MARK)
        if mark and origin.isdigit():
            return int(origin), text
    return None, reason
