"""The flight recorder: each communicator keeps its last collectives in a ring and writes them out
when it breaks, so that a hang or a failure can be explained after the fact.

Every collective a communicator runs is one entry (sequence number, collective, size, dtype, op,
root, memory, start and end times, state started/completed/failed); the last
``DDL_FLIGHT_RECORDER_ENTRIES`` are kept. A record also lists the newest point-to-point sends
and receives (``p2p``: op, peer, tag, bytes, posted and end times, state, error type). Recording costs two clock reads and one small tuple per
call: the algorithm and the execution path are worked out only when the record is read. When a
collective fails (timeout, peer failure, mismatch: anything that breaks the communicator), and
when the communicator is closed, each rank writes its record as JSON, one file per rank, into the
``DDL_FLIGHT_RECORDER`` directory, and a failure's message names the file. So does a rank stopped
by SIGTERM (how ddlrun, and most launchers, stop the others when one rank fails): the rank that
was behind is often the one busy elsewhere, not in a collective, and would otherwise leave
nothing. ``python -m
ddlcore.trace DIR`` merges the ranks' files and says which rank was behind, in which collective.
The files hold plain JSON only; nothing is pickled.

A record is evidence, so nobody else may write where it goes: the directory is made 0700 where
it is missing, and one that belongs to another user, is writable by others, or is a symlink is
refused when the recorder is made (a warning; the record stays in memory, and the job's
collectives run as ever: diagnostics never break them). Each record is written 0600 (host names,
pids and error text are nobody else's business) to a random temporary name, opened with
O_EXCL|O_NOFOLLOW relative to the checked directory, then renamed into place.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import secrets
import signal
import socket
import stat
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping
from typing import Any

from ddlcore import config
from ddlcore.collectives import HAS_ROOT
from ddlcore.errors import DDLError
from ddlcore.planning import tuning
from ddlcore.private_dir import UnsafeDirectoryError, open_private_dir

log = logging.getLogger("ddlcore")

FORMAT = "ddlcore-flight-record"
VERSION = 1
STARTED, COMPLETED, FAILED = "started", "completed", "failed"
_STATES = (STARTED, COMPLETED, FAILED)

# An entry while recording: a tuple of what the call was and when it started, in slot
# seq % N of a list made once, and its end time in the same slot of another: 0.0 while started,
# the time it completed, or minus the time it failed. Nothing is allocated per call but the
# tuple, which replaces the one N calls older.
_SEQ, _COLL, _COUNT, _DTYPE, _OP, _ROOT, _MEMORY, _START = range(8)
_REFUSED = -1.0  # the end of a call the broken communicator refused (left out of the record)

# Communicators made in this process per rendezvous address, so that a second one (an init after
# a failure, or a sub-communicator) writes its own file instead of overwriting the first's.
_made: dict[str, int] = {}
_made_lock = threading.Lock()


# Recorders to write when SIGTERM arrives: those with a directory, not failed and not closed.
_live: weakref.WeakSet[FlightRecorder] = weakref.WeakSet()
_sigterm_installed = False
# How long a SIGTERM waits for another thread's write of the record before ending the process.
_SIGNAL_WAIT_S = 2.0


def _watch_sigterm(recorder: FlightRecorder) -> None:
    """Write ``recorder`` if this process gets SIGTERM. The handler is installed once, only
    from the main thread and only where SIGTERM has its default action (never over the
    program's own handler); after writing, it lets the signal end the process as before."""
    global _sigterm_installed
    _live.add(recorder)
    if _sigterm_installed or threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not allowed here (an embedded interpreter)
        return
    _sigterm_installed = True


def _on_sigterm(signum: int, frame: Any) -> None:
    for recorder in list(_live):
        recorder.terminated(signum)
    if signal.getsignal(signum) is not _on_sigterm:
        return  # a handler installed since calls us (a framework's graceful shutdown): its call
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def open_directory(path: str, create: bool = True) -> int:
    """The record directory ``path``, checked (`ddlcore.private_dir.open_private_dir`).

    Raises
    ------
    UnsafeDirectoryError
        ``path`` is not this user's alone, with the reason and what to do.
    OSError
        It cannot be made or opened.
    """
    try:
        return open_private_dir(path, create)
    except UnsafeDirectoryError as exc:
        raise UnsafeDirectoryError(
            f"{exc}: another user could forge or block the records there; give "
            "DDL_FLIGHT_RECORDER a directory only you can write (or one that does not exist yet)"
        ) from None


def file_name(rank: int, comm_index: int) -> str:
    """The file of ``rank``'s record of the ``comm_index``-th communicator of its process."""
    return f"rank{rank}.json" if comm_index == 0 else f"rank{rank}.comm{comm_index}.json"


class FlightRecorder:
    """The last collectives of one communicator, and where to write them when it breaks.

    Parameters
    ----------
    rank, size : int
        The communicator's rank and size.
    job : str
        What tells this job apart from others writing into the same directory (the rendezvous
        address).
    entries : int
        How many collectives to keep (``DDL_FLIGHT_RECORDER_ENTRIES``; 0: recording is off).
    directory : str
        Where to write the record (``DDL_FLIGHT_RECORDER``; empty: never written).
    describe : callable, optional
        ``describe(collective, nbytes, cuda) -> (algorithm, path)``: how the communicator runs
        such a call; asked only when the record is read.
    context : mapping, optional
        More about the communicator for the record's header (transports, box, timeout).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        job: str,
        entries: int,
        directory: str = "",
        describe: Callable[[str, int, bool], tuple[str, str]] | None = None,
        context: Mapping[str, Any] | None = None,
    ) -> None:
        self.rank, self.size, self.job = rank, size, job
        self.capacity = entries
        self.directory = directory
        if directory and entries > 0:
            self.directory = _checked(rank, directory)
        self._describe = describe
        self._context = dict(context or {})
        self._calls: list[tuple[Any, ...] | None] = [None] * entries
        self._ends = [0.0] * entries
        # The error that broke the communicator, summarized (the exception itself would keep
        # its traceback's frames and buffers alive).
        self.failure: dict[str, Any] | None = None
        with _made_lock:
            self.comm_index = _made.get(job, 0)
            _made[job] = self.comm_index + 1
        self.created = time.time()
        self.written: str | None = None  # the path of the record written after a failure
        self._write_lock = threading.Lock()  # a signal handler must not write over a write
        # The write in progress (reason, error) and its thread: a SIGTERM that interrupts it on
        # that thread does it again itself, since the process ends right after the handler.
        self._writing: tuple[str, BaseException | None] | None = None
        self._writer: int | None = None
        # The communicator's newest point-to-point messages, asked for when a record is made
        # (`ddlcore.p2p.PointToPoint.history`): a rank stuck in a recv says so.
        self.p2p_history: Callable[[], list[dict[str, Any]]] | None = None

    @classmethod
    def for_communicator(
        cls, comm: Any, job: str, environ: Mapping[str, str] | None = None
    ) -> FlightRecorder:
        """The recorder of ``comm`` as the environment configures it."""

        def describe(collective: str, nbytes: int, cuda: bool) -> tuple[str, str]:
            choice = comm.describe(collective, nbytes)
            if choice.algorithm == tuning.DIRECT:  # the host collectives (hostcoll)
                return choice.algorithm, "boards"
            if choice.host_path:
                return choice.algorithm, "host-staged"
            return choice.algorithm, "device" if cuda else "schedule"

        context = {
            "local_rank": comm.local_rank,
            "local_size": comm.local_size,
            "box": comm.topology.shape,
            "timeout": comm.timeout,
            "transports": {str(p): t for p, t in sorted(comm.transports.items())},
        }
        recorder = cls(
            comm.rank,
            comm.size,
            job,
            config.get("DDL_FLIGHT_RECORDER_ENTRIES", environ),
            config.get("DDL_FLIGHT_RECORDER", environ),
            describe,
            context,
        )
        if recorder.directory and recorder.enabled:
            _watch_sigterm(recorder)
        return recorder

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    @property
    def path(self) -> str:
        """Where this rank's record goes (meaningful when a directory is set)."""
        return os.path.join(self.directory, file_name(self.rank, self.comm_index))

    # --- recording (the hot path) ---------------------------------------------------------------
    def recording(self, execute: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
        """``execute(call, seq)`` with each call recorded; ``execute`` itself when recording is
        off. ``execute`` is a communicator's: its first failure breaks it, and it refuses every
        call after that (those are not recorded)."""
        if not self.enabled:
            return execute
        calls, ends, n, clock, recorder = self._calls, self._ends, self.capacity, time.time, self

        def run(call: Any, seq: int) -> Any:
            inp = call.inp
            slot = seq % n
            calls[slot] = (
                seq,
                call.collective,
                call.count,
                inp and inp.dtype,
                call.op,
                call.root,
                inp and inp.memory,
                clock(),
            )
            ends[slot] = 0.0
            try:
                result = execute(call, seq)
            except BaseException as exc:
                recorder.call_failed(exc, slot)
                raise
            ends[slot] = clock()
            return result

        return run

    def slots(self) -> tuple[list[Any], list[float]] | None:
        """The lists `recording` writes, for the compiled front end
        (``ddlcore.execution._frontend``), which records its calls the same way: slot ``seq %
        capacity`` of the first gets (seq, collective, count, dtype, op, root, memory, start),
        of the second 0.0, then the end time. None when recording is off."""
        return (self._calls, self._ends) if self.enabled else None

    def call_failed(self, exc: BaseException, slot: int) -> None:
        """The call recorded in ``slot`` raised ``exc``: its end is the failure's time."""
        self._ends[slot] = -time.time()
        self.failed(exc, slot)

    # --- reading ----------------------------------------------------------------------------------
    def entries(self) -> list[dict[str, Any]]:
        """The kept collectives, oldest first, as plain dicts (see `document`)."""
        raw = sorted(
            (
                (c, end)
                for c, end in zip(list(self._calls), list(self._ends), strict=True)
                if c is not None
            ),
            key=lambda ce: ce[0][_SEQ],
        )
        known: dict[tuple[str, int, bool], tuple[str, str]] = {}
        out = []
        for e, end in raw:
            dtype = e[_DTYPE]
            nbytes = e[_COUNT] * dtype.itemsize if dtype is not None else 0
            cuda = e[_MEMORY] is not None and e[_MEMORY].value == "cuda"
            key = (e[_COLL], nbytes, cuda)
            if key not in known:
                known[key] = self._algorithm_and_path(*key)
            algorithm, path = known[key]
            op = e[_OP]
            if end == _REFUSED:
                continue
            if end and abs(end) < e[_START]:  # read as a call was starting: the end is the last's
                end = 0.0
            out.append(
                {
                    "seq": e[_SEQ],
                    "collective": e[_COLL],
                    "count": e[_COUNT],
                    "bytes": nbytes,
                    "dtype": dtype.name if dtype is not None else None,
                    "op": op.name.lower() if op is not None else None,
                    "root": e[_ROOT] if e[_COLL] in HAS_ROOT else None,
                    "memory": e[_MEMORY].value if e[_MEMORY] is not None else None,
                    "algorithm": algorithm,
                    "path": path,
                    "start": e[_START],
                    "end": abs(end) if end else None,
                    "state": COMPLETED if end > 0 else FAILED if end < 0 else STARTED,
                }
            )
        return out

    def _algorithm_and_path(self, collective: str, nbytes: int, cuda: bool) -> tuple[str, str]:
        if self._describe is None:
            return "?", "?"
        try:
            return self._describe(collective, nbytes, cuda)
        except Exception as exc:  # a record is still worth having without these
            log.debug(
                "rank %d: flight recorder could not describe %s: %s", self.rank, collective, exc
            )
            return "?", "?"

    def document(self, reason: str, error: BaseException | None = None) -> dict[str, Any]:
        """The whole record as written to the file: who (rank, size, host, pid, job), why
        (``reason``: "failure", "close", "SIGTERM" or "request"; the error that broke the
        communicator, if one did), and the entries."""
        err = _summary(error) if error is not None else self.failure
        return {
            "format": FORMAT,
            "version": VERSION,
            "job": self.job,
            "comm": self.comm_index,
            "rank": self.rank,
            "size": self.size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "created": self.created,
            "written": time.time(),
            "reason": reason,
            "error": err,
            **self._context,
            "capacity": self.capacity,
            "entries": self.entries() if self.enabled else [],
            "p2p": self.p2p_history() if self.p2p_history is not None else [],
        }

    # --- writing ----------------------------------------------------------------------------------
    def write(self, doc: dict[str, Any], path: str | None = None) -> str:
        """Write ``doc`` as JSON, 0600 (atomically: a reader never sees half a file); returns the
        path. The directory is checked again (`open_directory`): it may have been replaced since
        the recorder was made.

        Raises
        ------
        UnsafeDirectoryError, OSError
            The directory is not this user's alone, or the file cannot be written.
        """
        if path is None and not self.directory:
            raise ValueError("path: this recorder has no directory to write to")
        path = path or self.path
        folder, name = os.path.split(path)
        dir_fd = open_directory(folder or ".")
        try:
            # A name nobody can guess, made by this open only: nothing planted there is followed.
            tmp = f"{name}.{secrets.token_hex(8)}.tmp"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    f.write(dumps(doc))
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                raise
        finally:
            os.close(dir_fd)
        return path

    def failed(self, exc: BaseException, slot: int) -> None:
        """The collective in ``slot`` failed. The first failure broke the communicator: write
        the record and name its file in the error's message; later calls were refused."""
        if self.failure is not None:
            self._ends[slot] = _REFUSED
            return
        self.failure = _summary(exc)
        if not self.directory:
            _live.discard(self)
            return
        with self._write_lock:
            self.written = self._write_locked("failure", exc)
        _live.discard(self)  # only now: a SIGTERM during the write must still see this record
        if self.written is None:
            return
        note = (
            f"flight record: {self.written} (python -m ddlcore.trace {self.directory} "
            "merges every rank's)"
        )
        if isinstance(exc, DDLError) and exc.args and isinstance(exc.args[0], str):
            exc.args = (f"{exc.args[0]}\n{note}", *exc.args[1:])
        elif hasattr(exc, "add_note"):  # Python 3.11+: shown in the traceback
            exc.add_note(note)

    def closed(self) -> None:
        """The communicator is being closed: write the record unless a failure already did, so
        that a rank that left early is on file too."""
        if not self.directory or not self.enabled or self.failure is not None:
            _live.discard(self)
            return
        with self._write_lock:
            self._write_locked("close")
        _live.discard(self)

    def terminated(self, signum: int) -> None:
        """The process got ``signum`` (SIGTERM) and is about to end: write the record (or finish
        the write the signal interrupted; another thread's is waited for, briefly)."""
        writing = self._writing
        if writing is not None and self._writer == threading.get_ident():
            self._write_quietly(*writing)  # interrupted on this thread: it never resumes
            return
        if not self._write_lock.acquire(timeout=_SIGNAL_WAIT_S):
            return
        try:
            if self.failure is None:  # else failed() wrote it, under this lock
                self._write_quietly(signal.Signals(signum).name)
        finally:
            self._write_lock.release()

    def _write_locked(self, reason: str, exc: BaseException | None = None) -> str | None:
        """`_write_quietly` with ``_write_lock`` held, telling a signal handler what it is at."""
        self._writing, self._writer = (reason, exc), threading.get_ident()
        try:
            return self._write_quietly(reason, exc)
        finally:
            self._writing = self._writer = None

    def _write_quietly(self, reason: str, exc: BaseException | None = None) -> str | None:
        """Write the record; a failure to write is logged, never raised (the collective's
        error, or the closing, is what the caller is about)."""
        try:
            return self.write(self.document(reason, exc))
        except Exception as werr:
            log.warning(
                "rank %d: could not write the flight record to %s: %s",
                self.rank,
                self.directory,
                werr,
            )
            return None


def _checked(rank: int, directory: str) -> str:
    """``directory`` where it is fit for records (made 0700 where missing), else "" with a
    warning: recording goes on in memory, and nothing a collective does depends on it."""
    try:
        os.close(open_directory(directory))
    except (OSError, UnsafeDirectoryError) as exc:
        log.warning(
            "rank %d: flight records will not be written to %s: %s "
            "(the record is kept in memory: Communicator.flight_record())",
            rank,
            directory,
            exc,
        )
        return ""
    return directory


def _summary(exc: BaseException) -> dict[str, Any]:
    return {
        "type": type(exc).__name__,
        "message": str(exc) or type(exc).__name__,
        "peer": getattr(exc, "peer", None),
    }


def dumps(doc: dict[str, Any]) -> str:
    """JSON of a record, one entry per line (readable, and diff-able between ranks)."""
    head = {k: v for k, v in doc.items() if k != "entries"}
    text = json.dumps(head, indent=1)
    entries = ",\n".join("  " + json.dumps(e) for e in doc.get("entries", []))
    return text[:-2] + ',\n "entries": [\n' + entries + ("\n" if entries else "") + " ]\n}\n"


def load(path: str, owners: Collection[int] | None = None) -> dict[str, Any]:
    """Read one rank's record, checking it is one (JSON only; nothing is unpickled). A symlink
    is not followed, and only a regular file is read (a FIFO would block the reader).

    Parameters
    ----------
    path : str
        The record's file.
    owners : collection of int, optional
        The users whose files are read (None: anyone's); another's file could say anything.

    Raises
    ------
    ValueError
        The file is not a ddlcore flight record (or of a newer version), or is not one of
        ``owners``' regular files, with the reason.
    OSError
        It cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{path}: a symbolic link (not followed)") from None
        raise
    with os.fdopen(fd, encoding="utf-8") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file")
        if owners is not None and st.st_uid not in owners:
            raise ValueError(
                f"{path}: written by uid {st.st_uid}, neither you nor the directory's owner "
                "(another user's file could say anything)"
            )
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a ddlcore flight record")
    if doc.get("version") != VERSION:
        raise ValueError(
            f"{path}: flight record version {doc.get('version')!r}, this ddlcore "
            f"reads version {VERSION}"
        )
    for key, kind in (("rank", int), ("size", int), ("entries", list)):
        if not isinstance(doc.get(key), kind):
            raise ValueError(f"{path}: field {key!r} missing or not {kind.__name__}")
    for e in doc["entries"]:
        if not (
            isinstance(e, dict)
            and isinstance(e.get("seq"), int)
            and e.get("state") in _STATES
            and isinstance(e.get("start"), (int, float))
        ):
            raise ValueError(f"{path}: malformed entry {e!r:.200}")
    return doc
