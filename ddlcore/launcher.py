"""``ddlrun``: start the ranks of a job.

    ddlrun -np 4 [--transport tcp] [--timeout 60] [--topology 2x2] prog.py args...
    ddlrun -np 2 -m ddlcore.bench -b 4K -e 64M
    ddlrun -np 8 --hosts h1:4,h2:4 prog.py args...      # across hosts, through mpiexec

Local mode spawns N processes with the rendezvous variables set (``DDL_RANK``, ``DDL_SIZE``,
``DDL_LOCAL_RANK``, ``DDL_LOCAL_SIZE``, ``DDL_MASTER_ADDR``, ``DDL_MASTER_PORT``), prefixes every
line they print with ``[rank]``, forwards SIGINT/SIGTERM, and when one rank fails stops the
others (SIGTERM, then SIGKILL after a grace period) and exits with that rank's code. Each rank
runs in its own process group so its children are stopped too: no orphans, no hang.

With ``--hosts`` it hands the job to an MPI launcher (``mpiexec`` from the mpich wheel, or the
one on PATH); ``ddlcore.init()`` then finds rank and size from the MPI launcher's variables.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO

from ddlcore import config

GRACE_S = 3.0


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def program_argv(prog: str, args: Sequence[str], module: bool) -> list[str]:
    """The command a rank runs: ``-m module``, a ``.py`` script, or an executable."""
    if module:
        return [sys.executable, "-m", prog, *args]
    if prog.endswith(".py"):
        return [sys.executable, prog, *args]
    return [prog, *args]


def parse_hosts(spec: str) -> list[tuple[str, int]]:
    """``h1:4,h2:4`` -> [("h1", 4), ("h2", 4)]; a host without a count has one slot."""
    hosts = []
    for item in spec.split(","):
        if not item:
            continue
        name, _, slots = item.partition(":")
        try:
            count = int(slots) if slots else 1
        except ValueError:
            raise ValueError(f"--hosts: {item!r} is not host or host:slots") from None
        if not name or count < 1:
            raise ValueError(f"--hosts: {item!r} is not host or host:slots")
        hosts.append((name, count))
    if not hosts:
        raise ValueError("--hosts is empty")
    return hosts


def find_mpiexec() -> str | None:
    """mpiexec next to this Python (the mpich wheel puts it there), else on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(local, os.X_OK):
        return local
    return shutil.which("mpiexec")


def mpiexec_command(mpiexec: str, np_: int, hosts: str, forwarded: dict[str, str],
                    command: list[str]) -> list[str]:
    """Hydra's syntax: ``mpiexec -n N -hosts h1:4,h2:4 -genv K V ... prog args``."""
    slots = sum(n for _, n in parse_hosts(hosts))
    if slots < np_:
        raise ValueError(f"--hosts {hosts} has {slots} slots, fewer than -np {np_}")
    argv = [mpiexec, "-n", str(np_), "-hosts", hosts]
    for key, value in forwarded.items():
        argv += ["-genv", key, value]
    return argv + command


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


class LocalJob:
    """N local ranks and their output pumps."""

    def __init__(self, command: list[str], np_: int, env: dict[str, str], prefix: bool) -> None:
        self.procs: list[subprocess.Popen] = []
        self.pumps: list[_Output] = []
        for rank in range(np_):
            child_env = dict(os.environ)
            child_env.update(env)
            child_env.update({"DDL_RANK": str(rank), "DDL_SIZE": str(np_),
                              "DDL_LOCAL_RANK": str(rank), "DDL_LOCAL_SIZE": str(np_),
                              "PYTHONUNBUFFERED": "1"})
            proc = subprocess.Popen(command, env=child_env, start_new_session=True,
                                    stdout=subprocess.PIPE if prefix else None,
                                    stderr=subprocess.PIPE if prefix else None)
            self.procs.append(proc)
            if proc.stdout is not None and proc.stderr is not None:  # prefixing
                self.pumps.append(_Output(proc.stdout, sys.stdout, f"[{rank}] "))
                self.pumps.append(_Output(proc.stderr, sys.stderr, f"[{rank}] "))

    def signal_all(self, signum: int, skip: int | None = None) -> None:
        for rank, proc in enumerate(self.procs):
            if rank != skip and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signum)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self, skip: int | None = None) -> None:
        """SIGTERM every other rank's process group, SIGKILL whatever is left after the grace."""
        self.signal_all(signal.SIGTERM, skip)
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
            time.sleep(0.05)
        for proc in self.procs:
            try:  # the whole group: a rank's own children go too
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()

    def wait(self, job_timeout: float | None) -> int:
        """Exit code of the job: 0, the first failing rank's code, or 124 on --job-timeout."""
        deadline = None if job_timeout is None else time.monotonic() + job_timeout
        pending = set(range(len(self.procs)))
        while pending:
            for rank in sorted(pending):
                code = self.procs[rank].poll()
                if code is None:
                    continue
                pending.discard(rank)
                if code != 0:
                    what = f"code {code}" if code > 0 else _signal_name(code)
                    others = len(pending)
                    print(f"ddlrun: rank {rank} exited with {what}; terminating the other "
                          f"{others} rank{'s' if others != 1 else ''}", file=sys.stderr, flush=True)
                    self.stop(skip=rank)
                    self._drain()
                    return code if code > 0 else 128 - code
            if deadline is not None and time.monotonic() > deadline:
                print(f"ddlrun: job still running after --job-timeout {job_timeout:g} s; "
                      "stopping every rank", file=sys.stderr, flush=True)
                self.stop()
                self._drain()
                return 124
            time.sleep(0.02)
        self._drain()
        return 0

    def _drain(self) -> None:
        for pump in self.pumps:
            pump.thread.join(5)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ddlrun", description="Start the ranks of a ddlcore job.",
                                usage="ddlrun -np N [options] (prog.py | -m module | command) [args...]")
    p.add_argument("-np", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--transport", help="DDL_TRANSPORT for every rank (tcp, shm, mpi, ucx, auto)")
    p.add_argument("--timeout", help="DDL_TIMEOUT for every rank, in seconds")
    p.add_argument("--topology", help="DDL_TOPOLOGY for every rank, e.g. 4x2")
    p.add_argument("--hosts", help="h1:4,h2:4: launch across hosts through mpiexec")
    p.add_argument("--master-addr", default="127.0.0.1", help="rendezvous address (local mode)")
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: free)")
    p.add_argument("--job-timeout", type=float, default=None,
                   help="stop every rank and exit 124 after this many seconds")
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output with [rank]")
    p.add_argument("-m", dest="module", action="store_true", help="prog is a module (python -m)")
    p.add_argument("prog", help="program: script.py, module (with -m) or executable")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the program")
    return p


def _forwarded(args: argparse.Namespace) -> dict[str, str]:
    """The option values as environment variables, validated by config's own parsers."""
    out = {}
    for option, var in (("transport", "DDL_TRANSPORT"), ("timeout", "DDL_TIMEOUT"),
                        ("topology", "DDL_TOPOLOGY")):
        value = getattr(args, option)
        if value is None:
            continue
        try:
            config.VARS[var].parse(value)
        except ValueError as exc:
            raise ValueError(f"--{option} {value!r}: {exc}") from None
        out[var] = value
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error("-np must be at least 1")
    try:
        forwarded = _forwarded(args)
    except ValueError as exc:
        parser.error(str(exc))
    command = program_argv(args.prog, args.args, args.module)
    if args.hosts:
        mpiexec = find_mpiexec()
        if mpiexec is None:
            print("ddlrun: --hosts needs mpiexec; install it with pip install 'ddlcore[mpi]'",
                  file=sys.stderr)
            return 2
        try:
            argv_mpi = mpiexec_command(mpiexec, args.np, args.hosts, forwarded, command)
        except ValueError as exc:
            parser.error(str(exc))
        return subprocess.call(argv_mpi)
    env = dict(forwarded)
    env["DDL_MASTER_ADDR"] = args.master_addr
    env["DDL_MASTER_PORT"] = str(args.master_port or _free_port(args.master_addr))
    try:
        job = LocalJob(command, args.np, env, prefix=not args.no_prefix)
    except OSError as exc:
        print(f"ddlrun: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    received: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        received.append(signum)
        job.signal_all(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = job.wait(args.job_timeout)
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        _remove_shared_memory(job)
    return code


def _remove_shared_memory(job: LocalJob) -> None:
    """Ranks killed before closing leave their shm segments behind; every rank has exited now,
    so whatever carries their pids is garbage."""
    try:
        from ddlcore.transports.shm import remove_segments_of
    except ImportError:  # the shm transport is not built: it made nothing
        return
    removed = remove_segments_of({p.pid for p in job.procs if p.poll() is not None})
    if removed:
        print(f"ddlrun: removed {len(removed)} shared-memory segment(s) left by ranks that did "
              "not close", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
