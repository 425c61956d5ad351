"""The error hierarchy: every error ddlcore raises on its own account derives from `DDLError`.

Bad arguments are reported with the builtin `ValueError`/`TypeError` (naming the argument) before
any communication starts; failures of the job itself (a peer died, a collective disagreed across
ranks, a deadline passed, rendezvous failed) are `DDLError` subclasses whose message says which
rank, which collective, its sequence number, and what to do.
"""

from __future__ import annotations


class DDLError(RuntimeError):
    """Base class of every ddlcore failure that is not a plain argument error.

    A failure another rank told us of (an abort) says the cause once, in the words of the rank
    that saw it first: ``cause`` is that text (None: the message is the cause) and ``origin``
    that rank (None: this rank), both carried along when the failure is relayed further."""

    cause: str | None = None
    origin: int | None = None


class DDLTimeoutError(DDLError, TimeoutError):
    """A blocking wait passed its deadline (``DDL_TIMEOUT``)."""


class PeerFailureError(DDLError):
    """A peer closed its connection, died, or reported that it aborted.

    ``peer`` is the rank that failed, also when another rank relayed the failure to us (aborts
    carry their origin: `abort_reason`)."""

    def __init__(self, message: str, peer: int | None = None, cause: str | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        self.cause = cause


class CollectiveMismatchError(DDLError):
    """Ranks called collectives that disagree (size, dtype, op, root or kind)."""


class RendezvousError(DDLError):
    """The ranks could not find each other at init (store unreachable, not all ranks joined)."""


class StoreUnreachableError(RendezvousError):
    """The store could not be reached, or the connection to it was lost (rank 0, which serves
    it, has probably exited). Distinct from a wait that timed out while the store was up.
    Here, below the transports, which raise it when a peer's address cannot be looked up."""


class TransportUnavailableError(DDLError):
    """A transport was asked for but cannot run here; the message says why."""


class CommunicatorClosedError(DDLError):
    """The communicator was closed, or broken by an earlier failure, and cannot run collectives."""


class CommunicatorRevokedError(PeerFailureError, CommunicatorClosedError):
    """A rank revoked the communicator (`Communicator.revoke`): every pending and later call of
    it fails, on every rank. ``peer`` is the rank that revoked it. A `PeerFailureError`, as the
    failure that usually prompts a revoke is, and a `CommunicatorClosedError`, as what a later
    call of a broken communicator raises."""


class ExcludedError(DDLError):
    """This rank cannot go on with its job: the others excluded it (it was silent for longer
    than ``DDL_HEARTBEAT_TIMEOUT``: stopped, hung, cut off) and went on without it, or it is on
    the smaller side of a partition. Not a `PeerFailureError`: shrinking cannot help; the
    process should exit (``ddlrun --elastic`` starts a replacement, which joins by grow)."""


class ParametersDifferError(DDLError):
    """Data-parallel training found the ranks' parameters different where they must be equal
    (the PyTorch `DistributedOptimizer` checks at its first step)."""


# --- relaying a failure: the origin travels with the abort reason ----------------------------
# A rank that aborts because of another rank's failure tells its peers which rank that was and
# the cause, so every rank's PeerFailureError names the rank that failed (not the one that
# relayed it) and each message says the cause once. The origin rides in front of the reason,
# between record separators (a byte no message of ours contains; not NUL, where C may stop).
_MARK = "\x1e"


def root_cause(exc: BaseException) -> str:
    """What failed first, as the rank that saw it said it."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, str) else str(exc)


def failure_origin(exc: BaseException) -> int | None:
    """The rank a failure started at, as far as this rank knows: whom a `PeerFailureError`
    blames, or the origin a relayed error carries; None: this rank's own."""
    rank = exc.peer if isinstance(exc, PeerFailureError) else getattr(exc, "origin", None)
    return rank if isinstance(rank, int) and rank >= 0 else None


def rewrap(exc: DDLError, message: str, cause: str | None = None) -> DDLError:
    """An error of ``exc``'s class with ``message`` (more context around ``exc``), keeping its
    cause (``cause`` if given), its origin, and whom a `PeerFailureError` blames."""
    err = type(exc)(message)
    err.cause = cause if cause is not None else root_cause(exc)
    err.origin = exc.origin
    if isinstance(exc, PeerFailureError) and isinstance(err, PeerFailureError):
        err.peer = exc.peer
    return err


def abort_reason(exc: BaseException, reason: str) -> str:
    """The reason to send peers when aborting because of ``exc``: its cause (``reason``, our
    account without our "rank R: " prefix, where it has none), after the rank it came from
    when that is not us."""
    cause = getattr(exc, "cause", None)
    text = cause if isinstance(cause, str) else reason
    origin = failure_origin(exc)
    return text if origin is None else f"{_MARK}{origin}{_MARK}{text}"


def parse_reason(reason: str) -> tuple[int | None, str]:
    """(origin rank or None, cause) of an abort reason made by `abort_reason`."""
    if reason.startswith(_MARK):
        origin, mark, text = reason[1:].partition(_MARK)
        if mark and origin.isascii() and origin.isdigit():
            return int(origin), text
    return None, reason
