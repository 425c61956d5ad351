"""The files behind shared memory: `create_segment` makes and maps an owner-only segment in
``/dev/shm`` whose owner holds a lock on it while it lives; `remove_segments_of` and
`remove_orphans` unlink the segments of ranks that died, whoever notices first.
"""

from __future__ import annotations

import fcntl
import functools
import os
import time
from collections.abc import Callable

from ddlcore.transports import _shm

from ddlcore.errors import DDLError

SHM_DIR = "/dev/shm"
PREFIX = "ddl-"


def reserve_pages(fd: int, offset: int, length: int, what: str) -> None:
    """Allocate tmpfs pages now, so a full /dev/shm is an error here rather than a SIGBUS on
    first write."""
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        raise DDLError(
            f"cannot reserve {length >> 10} KiB of shared memory for {what} in "
            f"{SHM_DIR}: {exc}; free space there (df -h {SHM_DIR}) or use "
            "DDL_TRANSPORT=tcp"
        ) from None


# Segment paths -> the descriptor holding the owner's shared lock on it, until it is unlinked:
# the kernel drops the lock when the owner dies, however it dies (`remove_orphans`).
_OWNER_LOCKS: dict[str, int] = {}
# `remove_orphans` leaves younger segments alone: their owner may not hold its lock yet (it
# takes it right after creating the file, microseconds later).
_ORPHAN_MIN_AGE_S = 1.0
_SWEEP_EVERY_S = 10.0
_last_sweep = -_SWEEP_EVERY_S


def create_segment(name: str, nbytes: int, reserve: int, what: str) -> tuple[str, int]:
    """Create ``/dev/shm/<name>`` (owner-only) of ``nbytes``, its first ``reserve`` bytes
    allocated now, and map it; returns (path, address). Names start with `PREFIX` and the
    owner's pid, which is how `remove_segments_of` finds a dead rank's segments; the owner
    holds a lock on it until `unlink_quietly`, which is how `remove_orphans` tells a dead
    owner's segment from a live one. First removes the orphans of earlier jobs (at most every
    `_SWEEP_EVERY_S`: a sweep costs about 0.1 ms per segment in /dev/shm)."""
    global _last_sweep
    if time.monotonic() - _last_sweep >= _SWEEP_EVERY_S:
        _last_sweep = time.monotonic()
        remove_orphans()
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.ftruncate(fd, nbytes)
        reserve_pages(fd, 0, reserve, what)
        address = _shm.map_shared(fd, nbytes)
    except BaseException:
        os.unlink(path)
        os.close(fd)
        raise
    _OWNER_LOCKS[path] = fd
    return path, address


def _segment_owner(name: str) -> int | None:
    parts = name.split("-")
    if len(parts) >= 3 and parts[0] + "-" == PREFIX and parts[1].isdigit():
        return int(parts[1])
    return None


def _unlink_if_free(name: str, may_go: Callable[[os.stat_result], bool]) -> bool:
    """Unlink segment ``name`` if it is this user's, ``may_go(its stat)`` says so, and nobody
    holds its owner's lock (a live owner does, in any pid namespace); True if it went."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not may_go(st):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises while a live owner holds it
        os.unlink(path)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_segments_of(pids: set[int]) -> list[str]:
    """Unlink the segments owned by the given (dead) processes; returns the names removed.
    A survivor calls this for a peer it saw die, the launcher for ranks that died. Only this
    user's segments whose owner's lock is free go: a pid reused since (by a rank of another job,
    in this or another pid namespace) holds the lock on its own segments, which stay."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return []
    return [
        name
        for name in names
        if _segment_owner(name) in pids and _unlink_if_free(name, lambda st: True)
    ]


@functools.lru_cache(maxsize=1)
def _boot_time() -> float:
    """When this host booted (wall clock, whole seconds)."""
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _owner_gone(pid: int, since: float, boot: float) -> bool:
    """Whether process ``pid`` cannot be the one that made a segment that existed at ``since``
    (wall clock): no such pid here, or one started after that (the pid was reused). The start
    time computed from whole-second ``btime`` errs early, so a live owner is never taken for
    gone; a process of another pid namespace is, and the segment's lock decides then."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(b")") + 2 :].split()[19])  # field 22: start time
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return boot + ticks / _TICKS_PER_S > since


def remove_orphans() -> list[str]:
    """Unlink this user's segments whose owner is gone: its pid names no process that could
    have made the segment (`_owner_gone`) and nobody holds the owner's lock (a live owner in
    another pid namespace does). Every context creation calls this, so the segments of a rank
    that died unseen (SIGKILL, under any launcher) go at the next job on the host."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]
        boot = _boot_time() if names else 0.0
    except OSError:
        return removed
    now = time.time()
    for name in names:
        pid = _segment_owner(name)
        if pid is None or pid == os.getpid():
            continue

        def orphaned(st: os.stat_result, pid: int = pid) -> bool:
            return now - st.st_ctime >= _ORPHAN_MIN_AGE_S and _owner_gone(pid, st.st_ctime, boot)

        if _unlink_if_free(name, orphaned):
            removed.append(name)
    return removed


def cma_allowed() -> bool:
    """Whether this kernel lets a process read a same-user peer's memory (process_vm_readv):
    Yama's ptrace_scope 1 and up forbids it between processes that are not parent and child."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return f.read().strip() == "0"
    except OSError:  # no Yama: ordinary same-user ptrace rules, which allow it
        return True


def unlink_quietly(path: str) -> None:
    """Remove the segment at ``path`` (gone already is fine) and drop our lock on it."""
    try:
        os.unlink(path)
    except FileNotFoundError:  # a survivor took us for dead, or the launcher cleaned up
        pass
    fd = _OWNER_LOCKS.pop(path, None)
    if fd is not None:
        os.close(fd)
