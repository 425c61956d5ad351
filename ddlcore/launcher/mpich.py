"""MPICH's shared memory that a killed job left: each MPICH job maps a ``/dev/shm/mpich_shm_*``
file on every host until its ranks finalize, so a job whose mpiexec was SIGKILLed leaves one per
host. Their names carry no owner and MPICH takes no lock on them; what tells a dead job's from a
live one's is whether any process still maps or holds it open. ``ddlrun --hosts`` removes, on
its own host, before and after the job, those of this user that no process here uses
(`remove_dead_segments`).

A file of this user can only be used by this user's processes (it is 0600) or root's, and this
user's can all be inspected; one kept by a process of another pid namespace sharing
``/dev/shm`` is invisible, which is why a file younger than `_MIN_AGE_S` stays (a live job's
ranks map it while they start, and only need its name until then).
"""

from __future__ import annotations

import os
import time

SHM_DIR = "/dev/shm"
PREFIX = "mpich_shm_"
# Older than any MPI start-up: past it, only a rank that still attaches by name would miss it.
_MIN_AGE_S = 60.0


def _in_use(paths: set[str]) -> set[str] | None:
    """Those of ``paths`` some visible process maps or holds open; None where ``/proc`` is
    missing (nothing can be told)."""
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    used: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").partition("/")[2]
                    if "/" + path in paths:
                        used.add("/" + path)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target in paths:
                    used.add(target)
        except OSError:  # exited, or another user's: it cannot open this user's 0600 file
            continue
    return used


def remove_dead_segments() -> list[str]:
    """Unlink this user's ``/dev/shm/mpich_shm_*`` files that no process maps or holds open and
    that are older than `_MIN_AGE_S`; returns the names removed."""
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
    except OSError:
        return []
    now, uid = time.time(), os.getuid()
    candidates = set()
    for name in names:
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid == uid and os.path.isfile(path) and now - st.st_mtime >= _MIN_AGE_S:
            candidates.add(path)
    if not candidates:
        return []
    used = _in_use(candidates)
    if used is None:
        return []
    removed = []
    for path in sorted(candidates - used):
        try:
            os.unlink(path)
            removed.append(os.path.basename(path))
        except OSError:
            pass
    return removed
