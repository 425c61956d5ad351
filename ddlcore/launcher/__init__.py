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
with ``[rank]``, and stops them all when one fails (SIGTERM to every process of every rank,
SIGKILL after `GRACE_S`). ``--bind-to core`` pins each rank to its share of the CPUs
(`cpu_shares`; ddlrun runs on them while it starts the rank).

Nothing a rank started outlives the job. Each rank leads a session of its own, which holds every
process it starts, however deep (``ddlrun -np 2 sh -c 'python train.py'``: the shell and the
Python under it); whenever the job ends, ddlrun ends those sessions whole
(`ddlcore.launcher.sessions`) and removes the shared memory of the processes that did not close
(and, with ``--hosts``, MPICH's that nothing uses: `ddlcore.launcher.mpich`). When ddlrun dies,
even by SIGKILL: the kernel kills each rank it forked (``PR_SET_PDEATHSIG``, set in the child
before it runs the program), and ddlrun's watchdog, a process of its own started before the ranks,
sees ddlrun's end of a pipe close and kills the rest of the sessions
(`ddlcore.launcher.watchdog`). Nothing goes to the filesystem (failure records travel through a
pipe: `ddlcore.launcher.job`), so no end leaves a file behind.

Which rank is to blame: a rank whose collective failed because of another rank (a
`PeerFailureError`) sends that rank's number to ddlrun through ``DDL_FAILURE_DIR``
(`ddlcore.job.failure_report`, called by the communicator). Such ranks often exit before the rank that caused
it (which may still be printing its traceback or closing), so ddlrun reports the first rank to
fail that names no other rank, waiting up to `GRACE_S` for the rank the others name.

Signals: the first SIGINT or SIGTERM is forwarded to the ranks (SIGINT is restored to its default
in them, so a ddlrun started with SIGINT ignored, as a background job of a script is, still stops
them); a second one sends SIGTERM, then SIGKILL after `GRACE_S`; a third sends SIGKILL.

With ``--hosts`` it hands the job to an MPI launcher (``mpiexec`` from the mpich wheel, or the
one on PATH, Hydra's syntax); ``ddlcore.init()`` then finds rank and size from the MPI launcher's
variables, and the ranks agree on a secret over MPI (nothing secret goes on mpiexec's command
line).

Mistakes are found once, before any rank starts, and every error is one line
(``ddlrun: error: ...``; the traceback of an unexpected one with ``DDL_DEBUG=1``): a missing
script (``prog.py``, ``python [options] prog.py``), module (``-m``, looked up as the ranks' Python
will: the working directory first) or command, and a transport that cannot run a local job
(``mpi``, which needs an MPI launcher: ``--hosts``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import NoReturn

from ddlcore import config
from ddlcore.errors import DDLError
from ddlcore.job import store_listen
from ddlcore.job.placement import cpu_shares
from ddlcore.launcher import mpich
from ddlcore.launcher.job import GRACE_S as GRACE_S  # re-exported: tests read it here
from ddlcore.launcher.job import LocalJob, _die_with_parent


def _free_port(host: str, taken: int) -> int:
    """A free port other than ``taken``, for torch's store (torch binds it itself)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != taken:
            return port


def program_argv(prog: str, args: Sequence[str], module: bool) -> list[str]:
    """The command a rank runs: ``-m module``, a ``.py`` script, or an executable."""
    if module:
        return [sys.executable, "-m", prog, *args]
    if prog.endswith(".py"):
        return [sys.executable, prog, *args]
    return [prog, *args]


# A Python interpreter's name, as a user types it: python, python3, python3.12.
_PYTHON = re.compile(r"python[0-9.]*")


def python_script(args: Sequence[str]) -> str | None:
    """The file ``python ARGS`` runs: its first argument that is not an option or an option's
    value; None where it runs no file (``-c``, ``-m``, ``-``, ``-V``, ``--help``)."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            return args[i + 1] if i + 1 < len(args) else None
        if arg == "--check-hash-based-pycs":  # the one long option with a value
            i += 2
            continue
        if arg.startswith("--") or arg == "-":
            return None  # --help, --version; "-": the program comes on stdin
        if not arg.startswith("-"):
            return arg
        for j, letter in enumerate(arg[1:], 1):  # a cluster of short options, like -uBc
            if letter in "cm":
                return None
            if letter in "WX":  # its value is the rest of this argument, else the next one
                i += j == len(arg) - 1
                break
        i += 1
    return None


def _module_found(name: str) -> bool:
    """Whether ``python -m name``, run in ddlrun's working directory, finds the module: that
    directory first, then the path the ranks share with ddlrun (ddlrun's own first entry is its
    script's directory, not the ranks'). Only the top-level package is looked up: finding a
    submodule would import (run) its package here."""
    top = name.partition(".")[0]
    saved = sys.path[:]
    rest = sys.path if getattr(sys.flags, "safe_path", False) else sys.path[1:]
    sys.path[:] = [os.getcwd(), *rest]
    try:
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved


def check_program(prog: str, module: bool, args: Sequence[str] = ()) -> None:
    """Raise ValueError (one line) if the program cannot be started here: better once in ddlrun
    than once per rank. ``args``: the program's arguments (``python``'s name its script)."""
    if module:
        if not _module_found(prog):
            raise ValueError(f"no module named {prog!r} (for python -m)")
    elif prog.endswith(".py"):
        if not os.path.isfile(prog):
            raise ValueError(f"no such script: {prog}")
    elif os.sep in prog:
        if not os.path.exists(prog):
            raise ValueError(f"no such file: {prog}")
        if not (os.path.isfile(prog) and os.access(prog, os.X_OK)):
            raise ValueError(f"not executable: {prog} (name its interpreter: sh {prog}, ...)")
    elif shutil.which(prog) is None:
        hint = f" (the file here is ./{prog})" if os.path.isfile(prog) else ""
        raise ValueError(f"command not found: {prog}{hint}")
    if not module and _PYTHON.fullmatch(os.path.basename(prog)):
        script = python_script(args)
        if script is not None and not os.path.exists(script):  # a directory or zip runs too
            raise ValueError(f"no such script: {script}")


def check_transport(option: str | None) -> None:
    """Raise ValueError (one line) if the transport, from ``--transport`` or else the
    environment, cannot carry a local job."""
    spec = config.get("DDL_TRANSPORT") if option is None else option.strip().lower()
    if spec == "mpi":
        where = "--transport mpi" if option is not None else "DDL_TRANSPORT=mpi"
        raise ValueError(
            f"{where} cannot run a local job: the mpi transport needs ranks started by an MPI "
            "launcher (ddlrun --hosts, or mpiexec)"
        )


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


class _Parser(argparse.ArgumentParser):
    """Errors in one line (``ddlrun -h`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
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
    from ddlcore.security import auth

    return {"DDL_SECRET": auth.new_secret()}


def main(argv: Sequence[str] | None = None) -> int:
    """ddlrun: parse, check, run; an error that escapes is one line (its traceback with
    ``DDL_DEBUG=1``)."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before the ranks' signal handling is in place, or after it
        print("ddlrun: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except Exception as exc:
        if config.debug():
            raise
        text = " ".join(str(exc).split()) or "(no message)"
        print(
            f"ddlrun: error: {type(exc).__name__}: {text} (DDL_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


def _main(argv: Sequence[str] | None) -> int:
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
            check_program(prog, args.module, prog_args)
            check_transport(args.transport)
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
    # Two ports: ddlcore's store, and torch's (a script's init_process_group serves it). The
    # store's sockets are bound here and handed to rank 0 (DDL_STORE_SOCKETS), so no other
    # process can take the port between its choice and rank 0's start.
    try:
        handoff = store_listen.Handoff(
            store_listen.listen_all(args.master_addr, args.master_port or 0)
        )
    except (DDLError, OSError) as exc:
        parser.error(str(exc))
    ddl_port = handoff.socks[0].getsockname()[1]
    torch_port = _free_port(args.master_addr, ddl_port)
    env.update(
        {
            "DDL_MASTER_ADDR": args.master_addr,
            "DDL_MASTER_PORT": str(ddl_port),
            "MASTER_ADDR": args.master_addr,
            "MASTER_PORT": str(torch_port),
        }
    )
    try:
        job = LocalJob(
            command, args.np, env, prefix=not args.no_prefix, cpus=cpus, store_sockets=handoff.name
        )
    except OSError as exc:
        handoff.close()
        print(f"ddlrun: cannot start {command[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    try:
        old = {s: signal.signal(s, job.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = job.wait(args.job_timeout)
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
    finally:
        job.close()
        handoff.close()
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
    _remove_mpich_leftovers()  # of jobs whose mpiexec was killed: MPICH never removes them
    # mpiexec dies with us too; its proxies then stop the ranks (they lose their connection).
    proc = subprocess.Popen(argv_mpi, preexec_fn=_die_with_parent())
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:  # mpiexec got the terminal's Ctrl-C too: let it finish
            continue
    _remove_mpich_leftovers()
    return code


def _remove_mpich_leftovers() -> None:
    removed = mpich.remove_dead_segments()
    if removed:
        print(
            f"ddlrun: removed {len(removed)} unused MPICH shared-memory file(s) "
            f"({mpich.SHM_DIR}/{mpich.PREFIX}*) left by killed jobs",
            file=sys.stderr,
        )
