"""What a rank started, found and ended by session: ddlrun starts each rank as the leader of a
session of its own, so the session id (the rank's pid) names every process the rank started,
however deep (a wrapper's program, its workers), even after the rank itself is gone, and even
when a shell with job control gave them process groups of their own. Only a process that calls
``setsid`` itself leaves; without cgroups no launcher can follow that one.

Used at every end of a local job: by ddlrun once its ranks have exited or been stopped, and by
its watchdog (`ddlcore.launcher.watchdog`) when ddlrun died without doing it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable

_POLL_S = 0.02


def visible() -> bool:
    """Whether sessions can be listed here (Linux's ``/proc``)."""
    return os.path.isdir("/proc/self")


def members(sids: Iterable[int]) -> dict[int, int]:
    """Live processes (not zombies) of the given sessions, pid -> session, from ``/proc``
    (empty where there is none).

    A session id cannot name another session while any process of the first is alive (the
    kernel keeps the number until the last member is gone), so every process found is one
    the session's rank started."""
    wanted = set(sids)
    found: dict[int, int] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    me = os.getpid()
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
            # After the command name, which may hold anything: state ppid pgrp session ...
            fields = stat[stat.rindex(b")") + 2 :].split()
            state, session = fields[0], int(fields[3])
        except (OSError, ValueError, IndexError):  # exited meanwhile
            continue
        if session in wanted and state not in (b"Z", b"X"):
            found[int(entry)] = session
    return found


def signal_sessions(sids: Iterable[int], signum: int) -> set[int]:
    """Send ``signum`` to every live process of the given sessions; returns their pids."""
    live = members(sids)
    for pid in live:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    return set(live)


def kill_sessions(sids: Iterable[int], timeout: float) -> set[int]:
    """SIGKILL every process of the given sessions, again until none is left (a member may be
    forking as it is killed) or ``timeout`` seconds have passed; returns the pids killed.
    Where sessions cannot be listed, SIGKILL the process groups the session leaders led.

    A process killed is gone from the sessions only once it has exited (its files closed,
    the locks on its shared memory released), which is when this returns."""
    sids = set(sids)
    if not visible():
        for sid in sids:
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return set()
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        live = signal_sessions(sids, signal.SIGKILL) if time.monotonic() < deadline else set()
        if not live:
            return killed
        killed |= live
        time.sleep(_POLL_S)


def remove_shared_memory(pids: Iterable[int]) -> list[str]:
    """Unlink the shm segments of the given dead processes, and this user's other segments
    whose owner is gone (a rank a wrapper started and that died before anyone saw its pid):
    `ddlcore.transports.shm`'s own rules (the owner's lock is free), so a live job's stay.
    Returns the names removed."""
    try:
        from ddlcore.transports.shm import remove_orphans, remove_segments_of
    except ImportError:  # the shm transport is not built: it made nothing
        return []
    return remove_segments_of(set(pids)) + remove_orphans()
