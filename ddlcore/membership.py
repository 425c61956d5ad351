"""``Communicator.shrink``: the survivors of a failure make a new communicator of themselves,
with no need of the world's rank 0 or the store it served.

Every rank already holds every other's control-plane address (from the init records) and the
job's key, so the survivors need nobody else::

    revoke the old communicator          (ranks still waiting in it fail, and come here too)
    agree on who is alive                (`agree` on a channel of shrink's own: the decision's
                                          failed set, the same on every survivor)
    the lowest survivor opens a store    (on an ephemeral port, with a fresh job id: nothing
                                          of an older epoch can connect to it) and posts its
                                          port to the others over the control plane
    each survivor joins it               (the init records, links and boards of the new shape,
                                          as split's children do; rank = its place among the
                                          survivors, in the old order)

Who is alive is what the ranks' failure detectors saw: a rank whose listener refuses or whose
connections all closed is dead; one silent for the heartbeat timeout may be stopped, or alive on
the other side of a partition. Without certainty, only the side holding more than half of the
old communicator's ranks (or exactly half, with its rank 0) goes on; the other raises
`ExcludedError` (no split brain), and so does a rank that wakes up after the others excluded it
(its plane was fenced).

A survivor lost during the build (its planes' connections close) makes every rank that sees it
close its store connection, and the store's rank closes the store: every build fails at once,
and the survivors agree again without it (attempt by attempt, each one agreement instance).
Every attempt ends in a second agreement (did every survivor build it, with nobody lost?),
so the survivors leave together with the new communicator or try again together. The old
communicator is closed on a thread of its own (its rank 0 may be gone: its close waits for
nobody).
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ddlcore.errors import DDLError, DDLTimeoutError, ExcludedError, PeerFailureError
from ddlcore.resilience.channel import AgreeChannel, excluded
from ddlcore.resilience.control import CLOSED, REFUSED, Address, ControlPlane
from ddlcore.resilience.mailbox import LOST, Mailbox

if TYPE_CHECKING:
    from ddlcore.communicator import Communicator

_log = logging.getLogger("ddlcore")


class Joiner(Protocol):
    """How a communicator makes another of some of its ranks (``ddlcore.bootstrap``)."""

    def __call__(
        self,
        rank: int,
        size: int,
        name: str,
        at: tuple[str, int] | None = None,
        on_client: Callable[[Any], None] | None = None,
    ) -> Communicator:
        """Meet in this communicator's store under ``name``, or in the one at ``at``."""

    def serve(self, host: str, size: int) -> Any:
        """Open a store for ``size`` ranks on an ephemeral port of ``host``."""


_STORE_AT = 1  # mailbox kind: the new store's port, from the lowest survivor
_ABANDON = 2  # mailbox kind: a survivor gave up this attempt (its watchers hear of it)
_PORT = struct.Struct("<H")


class Shrinking:
    """A communicator's part in its shrinks: the agreement channel and mailbox they use, named
    under the communicator's ``name`` (opened with the communicator, so that no peer's frame
    for them waits in the plane; closed with it)."""

    def __init__(self, plane: ControlPlane, name: str, rank: int, addresses: list[Address]) -> None:
        self.rank, self.size = rank, len(addresses)
        self.plane = plane
        self.agreement = AgreeChannel(plane, f"{name}#shrink", rank, addresses)
        self.mailbox = Mailbox(plane, f"{name}#shrink-mail", rank, addresses, alarms=(_ABANDON,))

    def close(self) -> bool:
        """Close both; True when the plane has no channel left."""
        a = self.agreement.close()
        return self.mailbox.close() or a


def shrink(
    comm: Communicator, shrinking: Shrinking, join: Joiner
) -> tuple[Communicator, list[int]]:
    """The new communicator of ``comm``'s survivors (see the module docstring), built by
    ``join`` from a store that the lowest survivor opens with ``join.serve``, and the
    survivors' ranks in ``comm``. Each attempt ends in a second agreement, on whether every
    survivor built it with nobody lost meanwhile: a build that failed on one rank only (or a
    death after some ranks finished theirs) starts every rank on the next attempt, never
    some with a communicator and some without."""
    deadline = time.monotonic() + comm.timeout
    comm.revoke()
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise DDLTimeoutError(
                f"rank {comm.rank}: shrink: no new communicator within DDL_TIMEOUT="
                f"{comm.timeout:g} s"
            )
        decision = shrinking.agreement.agree(True, left)
        attempt = shrinking.agreement.calls - 1  # the instance: the same on every rank
        alive = [r for r in range(comm.size) if r not in decision.failed]
        if comm.rank not in alive:
            raise PeerFailureError(
                f"rank {comm.rank}: shrink: the survivors lost this rank (its control "
                "connections closed) and went on without it; it cannot join them",
                comm.rank,
            )
        _check_majority(comm.rank, comm.size, alive, shrinking)
        new = None
        try:
            new = _build(comm, shrinking, alive, attempt, deadline, join)
        except DDLError as exc:
            _log.debug("rank %d: shrink attempt %d failed: %s", comm.rank, attempt, exc)
        if new is None:  # the others' builds fail at once too, not at their deadline
            for r in alive:
                if r != comm.rank:
                    shrinking.mailbox.post(r, attempt, _ABANDON, b"")
        confirm = shrinking.agreement.agree(new is not None, max(0.0, deadline - time.monotonic()))
        if confirm.value and confirm.failed == decision.failed:
            _log.debug(
                "rank %d: shrunk to rank %d of %d (lost %s)",
                comm.rank,
                new.rank,  # type: ignore[union-attr]
                new.size,  # type: ignore[union-attr]
                sorted(decision.failed),
            )
            return new, alive  # type: ignore[return-value]
        if new is not None:
            threading.Thread(target=close_quietly, args=(new,), daemon=True).start()


def _check_majority(rank: int, size: int, alive: list[int], shrinking: Shrinking) -> None:
    """Go on only with more than half of the ``size`` ranks alive, or exactly half with rank
    0 among them, unless every rank left out is known dead here (see the module docstring)."""
    if 2 * len(alive) > size:
        return
    left_out = [r for r in range(size) if r not in alive]
    certain = (CLOSED, REFUSED)
    suspected = [
        r
        for r in left_out
        if shrinking.plane.how_lost(shrinking.agreement.addresses[r]) not in certain
    ]
    if not suspected or (2 * len(alive) == size and 0 in alive):
        return
    raise ExcludedError(
        f"rank {rank}: shrink: only {len(alive)} of {size} ranks are left here, and rank(s) "
        f"{suspected} went silent rather than died: they may be alive on the other side of a "
        "network partition, so this side stops (only a side with more than half of the ranks, "
        "or half with rank 0, goes on)"
    )


def watch(
    plane: ControlPlane, addresses: list[Address], rank: int, fail: Callable[[DDLError], None]
) -> Callable[[], None]:
    """Heartbeat the other members of a communicator (at ``addresses``; this one is ``rank``):
    ``fail`` gets the error when one goes silent, or when this rank is fenced. Returns the
    function that stops watching."""

    class _Watch:
        def on_silent(self, peer: Address) -> None:
            member = addresses.index(peer)
            fail(
                PeerFailureError(
                    f"rank {rank}: rank {member} sent no heartbeat for "
                    f"DDL_HEARTBEAT_TIMEOUT={plane.heartbeat_s:g} s (stopped, hung or cut off "
                    "from this rank): it is excluded; shrink() goes on without it",
                    member,
                )
            )

        def on_fenced(self, peer: Address) -> None:
            fail(excluded(rank, addresses.index(peer) if peer in addresses else None))

    return plane.watch([a for r, a in enumerate(addresses) if r != rank], _Watch())


def _build(
    comm: Communicator,
    shrinking: Shrinking,
    alive: list[int],
    attempt: int,
    deadline: float,
    join: Joiner,
) -> Communicator | None:
    rank, size, lowest = alive.index(comm.rank), len(alive), alive[0]
    # Unique in this process: under the name of the communicator it replaces.
    name = f"{shrinking.agreement.name}{comm.epoch + 1}.{attempt}"
    if size == 1:
        return join(0, 1, name)
    host = shrinking.agreement.addresses[lowest][0]
    server = None
    clients: list[Any] = []
    lock = threading.Lock()
    abandoned = False

    def on_alarm(rank: int, instance: int) -> None:
        nonlocal abandoned
        if rank in alive and instance in (LOST, attempt):  # fail now, not at the deadline
            with lock:
                abandoned = True
                if server is not None:
                    server.close(timeout=0.0)
                for client in clients:
                    client.abort()

    def on_client(client: Any) -> None:
        with lock:
            clients.append(client)
            if abandoned:
                client.abort()

    if comm.rank == lowest:
        server = join.serve(host, size)
        body = _PORT.pack(server.port)
        for r in alive[1:]:
            shrinking.mailbox.post(r, attempt, _STORE_AT, body)
        port = server.port
    else:
        got = shrinking.mailbox.take(lowest, attempt, _STORE_AT, deadline)
        if got is None:
            return None
        (port,) = _PORT.unpack(got)
    stop = shrinking.mailbox.watch(on_alarm)
    try:
        return join(rank, size, name, at=(host, port), on_client=on_client)
    except BaseException:
        if server is not None:
            server.close(timeout=0.0)
        raise
    finally:
        stop()


def close_quietly(comm: Communicator) -> None:
    """Close ``comm``, which failed or was replaced: what it cannot release cleanly (its
    peers are gone) is released anyway."""
    try:
        comm.close()
    except Exception:
        _log.debug("rank %d: closing a communicator left behind", comm.rank, exc_info=True)
