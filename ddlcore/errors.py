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
    """A peer closed its connection, died, or reported that it aborted."""

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


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
