"""Where a job's ranks run: the ranks that share a machine on CPU blocks of their own.

Launchers that leave placement to the kernel (MPICH's ``mpiexec``, ``torchrun``, a plain
``ddlrun``) give every rank all the CPUs. Beside another busy process the kernel then often puts
two ranks of the job on one CPU, and every small collective becomes a pair of context switches
(on two vCPUs, 4 KB allreduce: ~2 µs with a CPU per rank, ~15 µs packed). So `init()` pins
local rank i to the i-th of ``local_size`` equal blocks of those CPUs, as Open MPI and Intel MPI
bind by default (local: on one running kernel, `machine_id`, so that emulated hosts on one
machine count as one), cut in `cpu_order` (a core's hardware threads and a NUMA node's cores
side by side, so a block holds them together where its size allows).

What is pinned is the thread that called `init()`, and what it starts afterwards (threads, data
loader processes); threads started before keep their CPUs. ``DDL_BIND`` decides when: ``auto``
binds only where the launcher did not (every local rank reports the same CPUs), there are no
more local ranks than CPUs, and the host has no NVIDIA GPU (a GPU rank belongs near its GPU's
NUMA node, which init does not know); ``block`` binds on GPU hosts too; ``none`` never binds.
Either way a rank is not pinned to CPUs where ranks of another job of the same user are pinned
(the claims file; a claim lasts until its communicator closes or its process exits): a second
job on the host is left to the kernel, which places it around the first, rather than pinned on
top of it as two Open MPI jobs are. Closing the communicator unpins.

The claims live where only the user can have put them: every job must find them at a fixed
name, and a fixed name in a folder anyone can write, another user can take first (and then read,
bend or block the claims; a sticky /dev/shm keeps the name's owner from removing it). So the file
``cpus`` is kept in a directory checked at each use (a real one, ours, writable by nobody else),
the first of `claims_dirs` that will do: ``/dev/shm/ddlcore-<uid>.d``, made 0700; where another
user took that name, ``~/.cache/ddlcore/cpus-<machine>`` (nobody else can make a name there,
while any suffix in /dev/shm another user could work out, and take too). One already there is
preferred to one made afresh, so a job finds the claims of one that started while the first
place was taken. The last release (no live claim left) removes the file and its directory.
Where no place will do, ``auto`` pins nothing, and the DDL_DEBUG log says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import itertools
import logging
import os
import pwd
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from ddlcore.private_dir import open_private_dir

log = logging.getLogger("ddlcore")

_SYS_CPU = "/sys/devices/system/cpu"
# A peer's CPU list is text from the wire: cap what is parsed (CPU numbers, ranges).
_MAX_CPU = 1 << 16
_MAX_RANGES = 1024

# The claims file, in the directory `claims_dirs` finds.
CLAIMS_FILE = "cpus"

# The claims file is read up to this many bytes (one line per pinned rank: pid, start, job, cpus).
_MAX_CLAIMS_BYTES = 1 << 16

# How long init waits for the claims file's lock before it pins nothing.
_LOCK_WAIT_S = 2.0

# (the CPUs the launcher gave this thread, the CPUs ddlcore pinned it to), once it has, and
# how many open communicators pinned it (the last to close unpins).
_pinned: tuple[frozenset[int], frozenset[int]] | None = None
_holders = 0


@functools.cache
def sysfs_position(cpu: int) -> tuple[int, int, int]:
    """(NUMA node, package, core) of a logical CPU from sysfs; missing entries count as 0 and
    a missing core id as the CPU number itself (each CPU its own core)."""
    base = f"{_SYS_CPU}/cpu{cpu}"
    node = 0
    try:
        node = next(
            int(name[4:])
            for name in os.listdir(base)
            if name.startswith("node") and name[4:].isdigit()
        )
    except (OSError, StopIteration):
        pass

    def read(name: str, default: int) -> int:
        try:
            with open(f"{base}/topology/{name}") as f:
                return int(f.read())
        except (OSError, ValueError):
            return default

    return node, read("physical_package_id", 0), read("core_id", cpu)


def cpu_order(
    cpus: Iterable[int], position: Callable[[int], tuple[int, int, int]] = sysfs_position
) -> list[int]:
    """The CPUs in the order blocks are cut from: by NUMA node, package and core, so that a
    block holds whole cores of one node where it can."""
    return sorted(cpus, key=lambda cpu: (*position(cpu), cpu))


def cpu_shares(
    nranks: int,
    cpus: Iterable[int],
    position: Callable[[int], tuple[int, int, int]] = sysfs_position,
) -> list[list[int]]:
    """Each local rank's CPUs, cut from ``cpus``.

    Parameters
    ----------
    nranks
        The number of local ranks.
    cpus
        The logical CPUs the ranks may use.
    position
        A CPU's (NUMA node, package, core); sysfs by default.

    Returns
    -------
    list of list of int
        Per rank, its CPUs: with no more ranks than CPUs an equal block each in `cpu_order`
        (the first ``len(cpus) % nranks`` ranks one more), so a rank's compute threads keep
        several; with more ranks one CPU each, round robin.
    """
    # The schedules' even split; imported here, so ddlrun without binding loads no planning code.
    from ddlcore.algorithms.schedule import split

    order = cpu_order(cpus, position)
    if nranks > len(order):
        return [[order[rank % len(order)]] for rank in range(nranks)]
    return [order[offset : offset + length] for offset, length in split(len(order), nranks)]


def host_has_gpu() -> bool:
    """Whether an NVIDIA driver shows a GPU on this host (no CUDA library is loaded)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return os.path.exists("/dev/nvidia0")


def launcher_cpus() -> frozenset[int]:
    """The CPUs the launcher gave this thread: its current ones, unless ddlcore pinned it (a
    second `init()` in one process sees what the first one did not change)."""
    current = frozenset(os.sched_getaffinity(0))
    if _pinned is not None and current == _pinned[1]:
        return _pinned[0]
    return current


def encode(cpus: Iterable[int]) -> str:
    """A CPU set as ranges, "0-3,8,10-11" (the init record carries it)."""
    ranges = []
    # CPUs of one run of consecutive numbers share cpu - position in the sorted list.
    for _, run in itertools.groupby(enumerate(sorted(set(cpus))), lambda ic: ic[1] - ic[0]):
        run_cpus = [cpu for _, cpu in run]
        first, last = run_cpus[0], run_cpus[-1]
        ranges.append(f"{first}-{last}" if last != first else f"{first}")
    return ",".join(ranges)


def decode(text: str) -> frozenset[int] | None:
    """The CPU set `encode` wrote, or None for text it did not write (never an exception: a
    peer's unreadable list only means nothing is bound)."""
    if not text or text.count(",") >= _MAX_RANGES:
        return None
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, dash, high = part.partition("-")
            first = int(low)
            last = int(high) if dash else first
            if not 0 <= first <= last < _MAX_CPU:
                return None
            cpus.update(range(first, last + 1))
    except ValueError:
        return None
    return frozenset(cpus)


def plan(
    mode: str,
    local_rank: int,
    local_cpus: Sequence[frozenset[int] | None],
    gpu: bool,
    taken: frozenset[int] = frozenset(),
) -> tuple[list[int] | None, str]:
    """The CPUs to pin this rank to, or None, and why (for the DDL_DEBUG log).

    ``local_cpus`` holds the launcher's CPUs of every rank on this host, by local rank (None
    where a rank's list could not be read); ``taken``, the CPUs other jobs pinned ranks to."""
    nlocal = len(local_cpus)
    if mode == "none":
        return None, "DDL_BIND=none"
    if nlocal < 2:
        return None, "no other rank of the job runs on this host"
    first = local_cpus[0]
    if first is None or any(cpus != first for cpus in local_cpus):
        return None, "the launcher placed the local ranks (their CPUs differ)"
    if nlocal > len(first):
        return None, f"{nlocal} local ranks share {len(first)} CPUs"
    if mode == "auto" and gpu:
        return None, "a GPU host (DDL_BIND=block binds there too)"
    if taken & first:
        return None, f"another job pinned ranks to CPUs {encode(taken & first)}"
    return cpu_shares(nlocal, first)[local_rank], f"local rank {local_rank} of {nlocal}"


def pin(cpus: Sequence[int]) -> bool:
    """Pin the calling thread to ``cpus``; False (and a DDL_DEBUG line) where the kernel
    refuses, which leaves placement as it was rather than failing init."""
    global _pinned, _holders
    launcher = launcher_cpus()
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.debug("cannot pin to CPUs %s: %s; placement left to the kernel", list(cpus), exc)
        return False
    _pinned = (launcher, frozenset(os.sched_getaffinity(0)))
    _holders += 1
    return True


@functools.cache
def machine_id() -> str:
    """The running kernel's boot id, empty where it cannot be read. Ranks that share it share
    CPUs, whatever their host ids say (network namespaces or containers on one machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return text if _is_machine_id(text) else ""


def _is_machine_id(text: str) -> bool:
    return len(text) == 36 and all(c in "0123456789abcdef-" for c in text)


def record() -> str:
    """This rank's part of the init record: a fresh token (rank 0's names the job in the
    claims file), its `machine_id` ("-" where unknown) and the CPUs the launcher gave it."""
    return f"{os.urandom(8).hex()} {machine_id() or '-'} {encode(launcher_cpus())}"


def read_record(text: str) -> tuple[str, str, frozenset[int] | None]:
    """(token, machine id, CPUs) of a peer's `record`: empty strings and None for anything
    else, and an empty machine id where the peer did not know its own."""
    token, _, rest = text.partition(" ")
    machine, _, cpus = rest.partition(" ")
    if len(token) != 16 or not all(c in "0123456789abcdef" for c in token):
        return "", "", None
    if machine != "-" and not _is_machine_id(machine):
        return "", "", None
    return token, "" if machine == "-" else machine, decode(cpus)


def cpu_share(
    records: Sequence[tuple[str, str, frozenset[int] | None]], host_ids: Sequence[str]
) -> float:
    """The share of a CPU each rank has on the job's most crowded machine (at most 1): the CPUs
    the launcher gave its ranks over their number. ``records`` are every rank's `read_record`;
    ranks share a machine where their kernel's id matches, else where their host id does. 1
    where a machine's CPUs are unknown."""
    machines: dict[str, tuple[int, set[int] | None]] = {}
    for (_, machine, cpus), host in zip(records, host_ids, strict=True):
        key = machine or f"host {host}"
        count, union = machines.get(key, (0, set()))
        if union is not None:
            union = union | cpus if cpus is not None else None
        machines[key] = (count + 1, union)
    return min(
        (min(1.0, len(union) / count) for count, union in machines.values() if union),
        default=1.0,
    )


def claims_dirs(shared: str | None = None, home: str | None = None) -> list[str]:
    """Where this user's claims file may be, in the order every job of the user tries them:
    ``<shared>/ddlcore-<uid>.d``, then ``<home>/.cache/ddlcore/cpus-<machine>`` (a home may be
    shared between hosts; the claims are one machine's).

    Parameters
    ----------
    shared
        The host's shared scratch folder; /dev/shm, or /tmp where there is none.
    home
        The user's home (from the password database, not HOME: every job must agree).
    """
    uid = os.geteuid()
    if shared is None:
        shared = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    dirs = [os.path.join(shared, f"ddlcore-{uid}.d")]
    if home is None:
        try:
            home = pwd.getpwuid(uid).pw_dir
        except KeyError:
            home = ""
    if home and home != "/":
        machine = machine_id() or socket.gethostname()
        dirs.append(os.path.join(home, ".cache", "ddlcore", f"cpus-{machine}"))
    return dirs


def _claims_dir() -> tuple[int, str]:
    """The claims directory, open: the first of `claims_dirs` that exists and will do, else
    the first that can be made. PermissionError (each place and why) where none will do."""
    dirs = claims_dirs()
    refused: dict[str, str] = {}
    for create in (False, True):
        for path in dirs:
            if path in refused:
                continue
            try:
                fd = open_private_dir(path, create)
            except FileNotFoundError:
                if create:
                    refused[path] = "cannot be made"
                continue
            except OSError as exc:
                refused[path] = str(exc)
                continue
            for other, why in refused.items():
                log.debug("CPU claims: not in %s (%s); in %s", other, why, path)
            return fd, path
    raise PermissionError("no place for the CPU claims: " + "; ".join(refused.values()))


def _start_time(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot), telling a live rank from a reused pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _locked_claims() -> Iterator[int]:
    """The claims file, open and locked (one rank on the host reads and writes it at a time);
    left empty, it is removed, and its directory with it. OSError where it cannot be,
    TimeoutError where the lock stays taken past `_LOCK_WAIT_S` (a holder stopped mid-update
    must not stop init)."""
    deadline = time.monotonic() + _LOCK_WAIT_S
    dir_fd, folder, fd = _lock_claims(deadline)
    try:
        yield fd
    finally:
        try:
            if os.fstat(fd).st_size == 0:  # nobody's claim: tidy up, still under the lock
                os.unlink(CLAIMS_FILE, dir_fd=dir_fd)
                with contextlib.suppress(OSError):  # another job's rank made a claim since
                    os.rmdir(folder)
        except OSError as exc:
            log.debug("removing the CPU claims file in %s: %s", folder, exc)
        finally:
            os.close(fd)
            os.close(dir_fd)


def _lock_claims(deadline: float) -> tuple[int, str, int]:
    """(the claims directory, its path, the claims file), the file locked. A file the last
    rank of the user removed while this one waited for its lock is left for the one at its
    name (a claim written there would be seen by nobody)."""
    while True:
        dir_fd, folder = _claims_dir()
        try:
            fd = os.open(
                CLAIMS_FILE,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
        except FileNotFoundError:  # the directory was removed since it was opened: again
            os.close(dir_fd)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{folder} kept being removed") from None
            continue
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                raise PermissionError(f"{folder}/{CLAIMS_FILE} belongs to another user")
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{folder}/{CLAIMS_FILE} stayed locked {_LOCK_WAIT_S} s"
                        ) from None
                    time.sleep(0.001)
            locked = os.fstat(fd)
            with contextlib.suppress(FileNotFoundError):  # else: removed while this one waited
                at = os.stat(CLAIMS_FILE, dir_fd=dir_fd, follow_symlinks=False)
                if (at.st_dev, at.st_ino) == (locked.st_dev, locked.st_ino):
                    return dir_fd, folder, fd
        except BaseException:
            os.close(fd)
            os.close(dir_fd)
            raise
        os.close(fd)
        os.close(dir_fd)


def _live_claims(fd: int) -> list[tuple[int, str, str, frozenset[int]]]:
    """The claims of ranks still running, this process's own left out (it claims afresh)."""
    raw = os.pread(fd, _MAX_CLAIMS_BYTES, 0).decode("ascii", "replace")
    claims = []
    for line in raw.splitlines():
        fields = line.split(" ")
        if len(fields) != 4 or not fields[0].isdigit():
            continue
        pid, start, job, cpus = int(fields[0]), fields[1], fields[2], decode(fields[3])
        if cpus is not None and pid != os.getpid() and _start_time(pid) == start:
            claims.append((pid, start, job, cpus))
    return claims


def _write_claims(fd: int, claims: Iterable[tuple[int, str, str, frozenset[int]]]) -> None:
    """Replace the file's claims: written before the file is cut to length, so a full disk
    leaves the old claims rather than none."""
    data = "".join(f"{p} {s} {j} {encode(c)}\n" for p, s, j, c in claims).encode("ascii")
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def pin_local_rank(
    mode: str, job: str, local_rank: int, local_cpus: Sequence[frozenset[int] | None]
) -> tuple[list[int] | None, str]:
    """Decide (`plan`) and pin this rank, recording its claim; returns the CPUs it was pinned
    to (None: not pinned) and why. ``job`` names the job (the same on each of its ranks).
    Where the claims file cannot be used, ``auto`` pins nothing (other jobs' ranks may be on
    those CPUs) and ``block`` pins anyway."""
    gpu = mode == "auto" and host_has_gpu()
    chosen, why = plan(mode, local_rank, local_cpus, gpu)
    if chosen is None:
        return None, why
    try:
        with _locked_claims() as fd:
            claims = _live_claims(fd)
            taken = frozenset().union(*(c for _, _, other, c in claims if other != job))
            cpus, why = plan(mode, local_rank, local_cpus, gpu, taken)
            if cpus is None:
                return None, why
            if not pin(cpus):
                return None, f"the kernel refused CPUs {encode(cpus)}"
            mine = (os.getpid(), _start_time(os.getpid()) or "0", job, frozenset(cpus))
            try:
                _write_claims(fd, [*claims, mine])
            except OSError as exc:  # pinned all the same; only other jobs will not know
                log.debug("writing the CPU claims: %s", exc)
            return cpus, why
    except (OSError, TimeoutError) as exc:
        if mode == "auto":
            return None, f"other jobs' CPUs unknown ({exc})"
    return (chosen, why) if pin(chosen) else (None, f"the kernel refused CPUs {encode(chosen)}")


def release() -> None:
    """Undo the last `pin_local_rank` that pinned, once every communicator that pinned has
    closed: the calling thread back on the launcher's CPUs if it is still where ddlcore put
    it, and this process's claim dropped."""
    global _pinned, _holders
    if _pinned is None:
        return
    _holders -= 1
    if _holders > 0:
        return
    launcher, applied = _pinned
    _pinned = None
    try:
        if frozenset(os.sched_getaffinity(0)) == applied:
            os.sched_setaffinity(0, launcher)
        with _locked_claims() as fd:
            _write_claims(fd, _live_claims(fd))  # every claim but this process's
    except (OSError, TimeoutError) as exc:
        log.debug("releasing the pinned CPUs: %s", exc)
