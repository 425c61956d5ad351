"""``ddlrun``: start the ranks of a job, stop them together, and name the rank that failed first.

    ddlrun -np 4 [--transport tcp] [--timeout 60] [--topology 2x2] prog.py args...
    ddlrun -np 2 -m ddlcore.bench -b 4K -e 64M
    ddlrun -np 8 --hosts h1:4,h2:4 prog.py args...      # across hosts, through mpiexec
    ddlrun -np 2 --bind-to core prog.py args...         # each rank on its own CPUs

Local mode spawns N processes with the rendezvous variables set (``DDL_RANK``, ``DDL_SIZE``,
``DDL_LOCAL_RANK``, ``DDL_LOCAL_SIZE``, ``DDL_MASTER_ADDR``, ``DDL_MASTER_PORT``), torchrun's too
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, and
``MASTER_PORT``: another free port, for ``init_process_group``'s store, never ddlcore's) and a
fresh ``DDL_SECRET`` (in their environment, never on a command line), prefixes every line they print
with ``[rank]``, and stops them all when one fails (SIGTERM to each rank's process group, SIGKILL
after `GRACE_S`). Each rank dies with ddlrun, even when ddlrun is killed with SIGKILL: the kernel
sends it SIGKILL when ddlrun exits (``PR_SET_PDEATHSIG``, set in the child before it runs the
program, so it holds for any program, before it has imported anything). ``--bind-to core`` pins
each rank to its share of the CPUs (`cpu_shares`; ddlrun runs on them while it starts the rank).

Which rank is to blame: a rank whose collective failed because of another rank (a
`PeerFailureError`) writes that rank's number into ``DDL_FAILURE_DIR`` (`record_failure`, called
by the communicator). Such ranks often exit before the rank that caused it (which may still be
printing its traceback or closing), so ddlrun reports the first rank to fail that names no other
rank, waiting up to `GRACE_S` for the rank the others name. Signals: the first SIGINT or SIGTERM
is forwarded to the ranks (SIGINT is restored to its default in them, so a ddlrun started with
SIGINT ignored, as a background job of a script is, still stops them); a second one sends
SIGTERM, then SIGKILL after `GRACE_S`; a third sends SIGKILL.

With ``--hosts`` it hands the job to an MPI launcher (``mpiexec`` from the mpich wheel, or the
one on PATH, Hydra's syntax); ``ddlcore.init()`` then finds rank and size from the MPI launcher's
variables, and the ranks agree on a secret over MPI (nothing secret goes on mpiexec's command
line).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from ddlcore import config
from ddlcore.job.placement import cpu_shares
from ddlcore.launcher.job import GRACE_S as GRACE_S  # re-exported: tests read it here
from ddlcore.launcher.job import LocalJob, _die_with_parent, _remove_shared_memory
from ddlcore.launcher.job import record_failure as record_failure  # the communicator's import


def _free_ports(host: str, count: int) -> list[int]:
    """``count`` distinct free ports (all bound at once, so none is drawn twice)."""
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def program_argv(prog: str, args: Sequence[str], module: bool) -> list[str]:
    """The command a rank runs: ``-m module``, a ``.py`` script, or an executable."""
    if module:
        return [sys.executable, "-m", prog, *args]
    if prog.endswith(".py"):
        return [sys.executable, prog, *args]
    return [prog, *args]


def check_program(prog: str, module: bool) -> None:
    """Raise ValueError (one line) if the program cannot be started here: better once in ddlrun
    than once per rank."""
    if module:
        try:
            found = importlib.util.find_spec(prog) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"no module named {prog!r} (for python -m)")
    elif prog.endswith(".py"):
        if not os.path.isfile(prog):
            raise ValueError(f"no such script: {prog}")
    elif os.sep in prog:
        if not (os.path.isfile(prog) and os.access(prog, os.X_OK)):
            raise ValueError(f"no such executable: {prog}")
    elif shutil.which(prog) is None:
        raise ValueError(f"command not found: {prog}")


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


def mpiexec_command(
    mpiexec: str,
    np_: int,
    hosts: str,
    forwarded: dict[str, str],
    command: list[str],
    prefix: bool = False,
) -> list[str]:
    """Hydra's syntax: ``mpiexec -n N -hosts h1:4,h2:4 [-prepend-rank] -genv K V ... prog args``
    (``forwarded`` holds option values only: never a secret, which ``ps`` would show)."""
    slots = sum(n for _, n in parse_hosts(hosts))
    if slots < np_:
        raise ValueError(f"--hosts {hosts} has {slots} slots, fewer than -np {np_}")
    argv = [mpiexec, "-n", str(np_), "-hosts", hosts]
    if prefix:
        argv.append("-prepend-rank")  # "[rank] " before each line, as in local mode
    for key, value in forwarded.items():
        argv += ["-genv", key, value]
    return argv + command


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddlrun",
        description="Start the ranks of a ddlcore job.",
        usage="ddlrun -np N [options] (prog.py | -m module | command) [args...]",
    )
    p.add_argument("-np", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument(
        "--transport",
        help="DDL_TRANSPORT for every rank: tcp, shm, mpi, ucx or auto (default: the "
        "environment's, else auto)",
    )
    p.add_argument(
        "--timeout",
        help="DDL_TIMEOUT for every rank, in seconds (default: the environment's, else 600)",
    )
    p.add_argument(
        "--topology",
        help="DDL_TOPOLOGY for every rank, e.g. 4x2, holding -np ranks (default: derived "
        "from the hosts)",
    )
    p.add_argument("--hosts", help="h1:4,h2:4: launch across hosts through mpiexec")
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="rendezvous address (local mode; default: %(default)s)",
    )
    p.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: free)")
    p.add_argument(
        "--job-timeout",
        type=float,
        default=None,
        help="stop every rank and exit 124 after this many seconds (default: no limit)",
    )
    p.add_argument(
        "--bind-to",
        choices=["none", "core"],
        default="none",
        help="core: pin each local rank to its own share of the CPUs ddlrun may use (an equal "
        "block each; one CPU each, round robin, when ranks outnumber CPUs); none: leave "
        "placement to the kernel (default)",
    )
    p.add_argument("--no-prefix", action="store_true", help="do not prefix output with [rank]")
    p.add_argument("-m", dest="module", action="store_true", help="prog is a module (python -m)")
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="prog [args...]",
        help="the program (script.py, module with -m, or executable) and its arguments",
    )
    return p


def _forwarded(args: argparse.Namespace) -> dict[str, str]:
    """The option values as environment variables, validated by config's own parsers."""
    out = {}
    for option, var in (
        ("transport", "DDL_TRANSPORT"),
        ("timeout", "DDL_TIMEOUT"),
        ("topology", "DDL_TOPOLOGY"),
    ):
        value = getattr(args, option)
        if value is None:
            continue
        try:
            parsed = config.VARS[var].parse(value)
        except ValueError as exc:
            raise ValueError(f"--{option} {value!r}: {exc}") from None
        if option == "topology" and parsed and math.prod(parsed) != args.np:
            raise ValueError(
                f"--topology {value} holds {math.prod(parsed)} ranks, but -np is {args.np}"
            )
        out[var] = value
    return out


def _secret_env() -> dict[str, str]:
    """A fresh job secret for the local ranks, unless the user gave one."""
    if config.get("DDL_SECRET") or config.get("DDL_SECRET_FILE"):
        return {}
    from ddlcore.job import auth

    return {"DDL_SECRET": auth.new_secret()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.np < 1:
        parser.error("-np must be at least 1")
    if not args.command:
        parser.error(
            "no program given: ddlrun -np N prog.py [args...] (or -m module, or a command)"
        )
    prog, prog_args = args.command[0], args.command[1:]
    try:
        forwarded = _forwarded(args)
        if not args.hosts:  # other hosts may hold files this one lacks
            check_program(prog, args.module)
    except ValueError as exc:
        parser.error(str(exc))
    command = program_argv(prog, prog_args, args.module)
    if args.hosts:
        if args.bind_to != "none":
            parser.error(
                "--bind-to places local ranks; with --hosts give mpiexec's own binding "
                "(MPICH: mpiexec -bind-to core)"
            )
        return _run_mpiexec(parser, args, forwarded, command)
    cpus = cpu_shares(args.np, os.sched_getaffinity(0)) if args.bind_to == "core" else None
    env = dict(forwarded)
    env.update(_secret_env())
    # Two ports: ddlcore's store, and torch's (a script's init_process_group serves it).
    ports = _free_ports(args.master_addr, 2)
    ddl_port = args.master_port or ports[0]
    torch_port = ports[1] if ports[1] != ddl_port else ports[0]
    env.update(
        {
            "DDL_MASTER_ADDR": args.master_addr,
            "DDL_MASTER_PORT": str(ddl_port),
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(torch_port),
        }
    )
    failure_dir = tempfile.mkdtemp(prefix="ddlrun-")
    try:
        try:
            job = LocalJob(
                command,
                args.np,
                env,
                prefix=not args.no_prefix,
                failure_dir=failure_dir,
                cpus=cpus,
            )
        except OSError as exc:
            print(f"ddlrun: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
            return 127
        old = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = job.wait(args.job_timeout)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
            _remove_shared_memory(job)
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
    return code


def _run_mpiexec(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    forwarded: dict[str, str],
    command: list[str],
) -> int:
    mpiexec = find_mpiexec()
    if mpiexec is None:
        print(
            "ddlrun: --hosts needs mpiexec; install it with pip install 'ddlcore[mpi]'",
            file=sys.stderr,
        )
        return 2
    try:
        argv_mpi = mpiexec_command(
            mpiexec, args.np, args.hosts, forwarded, command, prefix=not args.no_prefix
        )
    except ValueError as exc:
        parser.error(str(exc))
    # mpiexec dies with us too; its proxies then stop the ranks (they lose their connection).
    proc = subprocess.Popen(argv_mpi, preexec_fn=_die_with_parent())
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # mpiexec got the terminal's Ctrl-C too: let it finish
            continue
