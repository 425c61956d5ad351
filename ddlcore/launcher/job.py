"""ddlrun's local job: spawn N ranks (each in a session of its own, ended with ddlrun however
ddlrun ends), copy their output with a ``[rank]`` prefix, forward and escalate signals, stop them
all when one fails, and name the rank that failed first, from what each rank recorded with
`ddlcore.job.failure_report.record_failure` (the rank's half, called by the communicator). `ddlcore.launcher` parses the
command line and starts a `LocalJob` or mpiexec.

Failure records travel through a pipe that ddlrun holds, not through files: ``DDL_FAILURE_DIR``
names ddlrun's write end as ``/proc/<ddlrun's pid>/fd/<n>``, which any process of the job can
open (a wrapper's program too: nothing needs to be inherited) and which vanishes with ddlrun, so
no end of a job, SIGKILL included, leaves anything in the filesystem.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import IO, TYPE_CHECKING

from ddlcore.launcher import sessions

if TYPE_CHECKING:
    from ddlcore.launcher.watchdog import Watchdog

GRACE_S = 3.0
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1
# Bounds the final sweep of the ranks' sessions (SIGKILLed processes exit at once unless stuck
# in the kernel).
_SWEEP_TIMEOUT_S = 30.0
_SESSION_POLL_S = 0.05  # a look at every process's /proc entry: not every _POLL_S


class _FailureRecords:
    """ddlrun's end of the pipe the ranks write `ddlcore.job.failure_report`'s lines into."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()  # neither is inherited by the ranks
        os.set_blocking(self._read, False)
        self.path = f"/proc/{os.getpid()}/fd/{self._write}"
        self._partial = b""

    def read(self, origins: dict[int, int]) -> None:
        """Add the records that arrived to ``origins`` (rank -> origin; a rank's first kept)."""
        while True:
            try:
                chunk = os.read(self._read, 4096)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            self._partial += chunk
        *lines, self._partial = self._partial.split(b"\n")
        for line in lines:
            try:
                rank, origin = (int(w) for w in line.split())
            except ValueError:  # not a record: a stray writer
                continue
            origins.setdefault(rank, origin)

    def close(self) -> None:
        for fd in (self._read, self._write):
            with contextlib.suppress(OSError):
                os.close(fd)


# --- ddlrun's half ----------------------------------------------------------------------------
class _Output:
    """Copies a child's pipe to our stream line by line, prefixed, without interleaving lines."""

    lock = threading.Lock()

    def __init__(self, pipe: IO[bytes], out: IO[str], prefix: str) -> None:
        self.thread = threading.Thread(target=self._pump, args=(pipe, out, prefix), daemon=True)
        self.thread.start()

    @classmethod
    def _pump(cls, pipe: IO[bytes], out: IO[str], prefix: str) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            if not line.endswith("\n"):
                line += "\n"
            with cls.lock:
                out.write(prefix + line)
                out.flush()
        pipe.close()


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def _die_with_parent() -> Callable[[], None]:
    """The child's set-up between fork and exec: SIGKILL when ddlrun exits, however it exits,
    and SIGINT back to its default (the ranks hear Ctrl-C only from ddlrun, which forwards it).

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits: ddlrun forks from its
    main thread, which lives as long as ddlrun. A parent that died before the prctl took effect
    is caught by comparing getppid() with the pid the parent had. Little runs here (libc is
    loaded before the fork), and the ranks are forked before ddlrun starts any thread, as
    preexec_fn requires."""
    parent = os.getpid()
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the ranks still stop with ddlrun's signals
        prctl = None

    def preexec() -> None:
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return preexec


@contextlib.contextmanager
def _forking_on(cpus: Sequence[int] | None, rank: int) -> Iterator[None]:
    """ddlrun itself on ``cpus`` while it starts ``rank``, which inherits them (so a CPU that
    cannot be used fails here, as an OSError naming the rank, not inside the child)."""
    if cpus is None:
        yield
        return
    own = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, set(cpus))
    except OSError as exc:
        raise OSError(
            exc.errno, f"cannot bind rank {rank} to CPUs {list(cpus)}: {exc.strerror}"
        ) from None
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


class LocalJob:
    """N local ranks, their output pumps, and the decision of which rank failed first.

    Each rank leads a session of its own; every end of the job ends those sessions whole
    (`close`, or the watchdog if ddlrun dies first: `ddlcore.launcher.watchdog`), so nothing a
    rank started outlives the job, a wrapper's program included."""

    def __init__(
        self,
        command: list[str],
        np_: int,
        env: dict[str, str],
        prefix: bool,
        cpus: Sequence[Sequence[int]] | None = None,
        store_sockets: str = "",
    ) -> None:
        """Start the ranks; ``cpus[rank]``: the CPUs that rank runs on (None: wherever the
        kernel puts it); ``store_sockets``: where rank 0 receives the store's listening sockets
        (``DDL_STORE_SOCKETS``, `ddlcore.job.store_listen.Handoff`). Raises OSError if a rank cannot be started (those started
        are stopped)."""
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[_Output] = []
        self.exits: dict[int, tuple[float, int]] = {}  # rank -> (when seen, exit code)
        self.origins: dict[int, int] = {}  # rank -> the rank it recorded as failing first
        self.signals: list[int] = []  # signals ddlrun received, in order
        self.kill_at: float | None = None  # SIGKILL every rank then (an escalated stop)
        self.ended: set[int] = set()  # pids of the ranks' processes killed at the end
        self.failures = _FailureRecords()
        self.watchdog = _start_watchdog()
        preexec = _die_with_parent()
        try:
            for rank in range(np_):
                child_env = dict(os.environ)
                child_env.update(env)
                child_env.update(
                    {
                        "DDL_RANK": str(rank),
                        "DDL_SIZE": str(np_),
                        "DDL_LOCAL_RANK": str(rank),
                        "DDL_LOCAL_SIZE": str(np_),
                        "RANK": str(rank),
                        "WORLD_SIZE": str(np_),
                        "LOCAL_RANK": str(rank),
                        "LOCAL_WORLD_SIZE": str(np_),
                        "DDL_FAILURE_DIR": self.failures.path,
                        "PYTHONUNBUFFERED": "1",
                    }
                )
                child_env.pop("DDL_STORE_SOCKETS", None)
                if rank == 0 and store_sockets:
                    child_env["DDL_STORE_SOCKETS"] = store_sockets
                with _forking_on(None if cpus is None else cpus[rank], rank):
                    proc = subprocess.Popen(
                        command,
                        env=child_env,
                        start_new_session=True,
                        preexec_fn=preexec,
                        stdout=subprocess.PIPE if prefix else None,
                        stderr=subprocess.PIPE if prefix else None,
                    )
                self.procs.append(proc)
                if self.watchdog is not None:
                    self.watchdog.watch(proc.pid)  # its session id
        except BaseException:
            self.stop()
            self.close()
            raise
        # Threads only now: forking with other threads running is what preexec_fn must avoid.
        for rank, proc in enumerate(self.procs):
            if proc.stdout is not None and proc.stderr is not None:  # prefixing
                self.pumps.append(_Output(proc.stdout, sys.stdout, f"[{rank}] "))
                self.pumps.append(_Output(proc.stderr, sys.stderr, f"[{rank}] "))

    def signal_all(self, signum: int, skip: int | None = None) -> None:
        for rank, proc in enumerate(self.procs):
            if rank != skip and proc.returncode is None:
                try:  # the whole group: a rank's own children go too
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def on_signal(self, signum: int, _frame: object = None) -> None:
        """ddlrun's SIGINT/SIGTERM handler: forward, then escalate (see the module doc)."""
        self.signals.append(signum)
        if len(self.signals) == 1:
            self.signal_all(signum)
        elif len(self.signals) == 2:
            self.signal_all(signal.SIGTERM)
            self.kill_at = time.monotonic() + GRACE_S
        else:
            self.signal_all(signal.SIGKILL)

    def stop(self, skip: int | None = None) -> None:
        """SIGTERM every process of the ranks' sessions (where they cannot be listed, the
        process groups of the ranks still running but ``skip``), SIGKILL what is left of them
        after the grace."""
        if sessions.visible():
            self.ended |= sessions.signal_sessions([p.pid for p in self.procs], signal.SIGTERM)
        else:
            self.signal_all(signal.SIGTERM, skip)
        self._end_sessions(time.monotonic() + GRACE_S)

    def _end_sessions(self, deadline: float) -> None:
        """Wait until ``deadline`` for every process of the ranks' sessions to exit, SIGKILL
        those left (a wrapper's program, a rank's children: at a normal end too, as a batch
        system ends a job step), and reap the ranks."""
        sids = [p.pid for p in self.procs]
        while time.monotonic() < deadline:
            live = sessions.members(sids)
            self.ended |= live.keys()  # their pids, for their shared memory
            if not live and all(p.poll() is not None for p in self.procs):
                break
            time.sleep(_SESSION_POLL_S)
        self.ended |= sessions.kill_sessions(sids, _SWEEP_TIMEOUT_S)
        for proc in self.procs:
            proc.wait()

    def close(self) -> None:
        """The end of the job: stop what still runs (ddlrun was interrupted before `wait`
        ended), remove the shared memory of ranks that did not close, release the watchdog and
        the failure pipe."""
        if any(p.poll() is None for p in self.procs):
            self.stop()
        removed = sessions.remove_shared_memory(self.ended | {p.pid for p in self.procs})
        if removed:
            print(
                f"ddlrun: removed {len(removed)} shared-memory segment(s) left by ranks that "
                "did not close",
                file=sys.stderr,
            )
        if self.watchdog is not None:
            self.watchdog.release()
        self.failures.close()

    def _poll(self) -> None:
        now = time.monotonic()
        for rank, proc in enumerate(self.procs):
            if rank not in self.exits:
                code = proc.poll()
                if code is not None:
                    self.exits[rank] = (now, code)
        self.failures.read(self.origins)  # after: a rank records before it exits

    def culprit(self, settled: bool) -> int | None:
        """The rank to blame among those that exited with an error, or None to wait longer.

        A failed rank that recorded no other rank as the origin of its failure is a root cause;
        the first of those to exit is to blame. If every failed rank names another, wait (until
        ``settled``) for the ranks they name; then blame the first failed rank."""
        failed = sorted((when, rank) for rank, (when, code) in self.exits.items() if code != 0)
        if not failed:
            return None
        origins = {rank: self.origins.get(rank) for _, rank in failed}
        roots = [rank for _, rank in failed if origins[rank] in (None, rank)]
        if roots:
            return roots[0]
        named = {o for o in origins.values() if o is not None and 0 <= o < len(self.procs)}
        if not settled and any(o not in self.exits for o in named):
            return None
        return failed[0][1]

    def wait(self, job_timeout: float | None) -> int:
        """Exit code of the job: 0, the culprit's code (128 + signal if a signal killed it),
        128 + the signal that stopped ddlrun, or 124 on --job-timeout. Every rank's session
        has ended when it returns."""
        deadline = None if job_timeout is None else time.monotonic() + job_timeout
        first_failure: float | None = None
        while True:
            self._poll()
            now = time.monotonic()
            failed = any(code != 0 for _, code in self.exits.values())
            if len(self.exits) == len(self.procs) and (self.signals or not failed):
                break  # every rank is done, without a failure to name (or after our signal)
            if self.kill_at is not None and now >= self.kill_at:
                self.signal_all(signal.SIGKILL)
                self.kill_at = None
            if not self.signals and any(code != 0 for _, code in self.exits.values()):
                if first_failure is None:
                    first_failure = now
                settled = now - first_failure >= GRACE_S or len(self.exits) == len(self.procs)
                rank = self.culprit(settled)
                if rank is not None:
                    return self._fail(rank)
            if deadline is not None and now > deadline and not self.signals:
                print(
                    f"ddlrun: job still running after --job-timeout {job_timeout:g} s; "
                    "stopping every rank",
                    file=sys.stderr,
                    flush=True,
                )
                self.stop()
                self._drain()
                return 124
            time.sleep(_POLL_S)
        self._end_sessions(time.monotonic() + GRACE_S)
        self._drain()
        if self.signals:
            name = signal.Signals(self.signals[0]).name
            print(f"ddlrun: stopped by {name}", file=sys.stderr, flush=True)
            return 128 + self.signals[0]
        return 0

    def _fail(self, rank: int) -> int:
        code = self.exits[rank][1]
        what = f"code {code}" if code > 0 else _signal_name(code)
        others = sum(1 for p in self.procs if p.poll() is None)
        if others == 0:
            stopping = ""
        elif others == 1:
            stopping = "; terminating the other rank"
        else:
            stopping = f"; terminating the other {others} ranks"
        print(f"ddlrun: rank {rank} exited with {what}{stopping}", file=sys.stderr, flush=True)
        self.stop(skip=rank)
        self._drain()
        return code if code > 0 else 128 - code

    def _drain(self) -> None:
        for pump in self.pumps:
            pump.thread.join(5)


def _start_watchdog() -> Watchdog | None:
    from ddlcore.launcher.watchdog import Watchdog  # not at import: it runs as python -m

    try:
        return Watchdog()
    except OSError as exc:
        print(
            f"ddlrun: cannot start the watchdog ({exc.strerror}): if ddlrun is killed, "
            "processes its ranks started may outlive it",
            file=sys.stderr,
        )
        return None
